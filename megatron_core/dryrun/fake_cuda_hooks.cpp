// Fake CUDA runtime hooks for dry runs on a CPU build of torch (see fake_cuda.py).
//
// A CPU build registers no device guard and no runtime hooks for CUDA, so fake CUDA tensors can be created
// (FakeTensorMode) but autograd aborts on them: its engine asks the device guard for the tensor's stream
// and the accelerator hooks for the current device. These registrations answer both for a device that
// does not exist: FakeGuardImpl (torch's own, from c10) keeps a device index and hands out null streams,
// and the hooks say CUDA is present. Nothing here can allocate or run on a GPU; real CUDA tensors cannot
// be made (there is no allocator), only fake ones.
#include <ATen/detail/CUDAHooksInterface.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/core/impl/FakeGuardImpl.h>

namespace megatron_core_dry_run {

struct FakeCUDAHooks : public at::CUDAHooksInterface {
  explicit FakeCUDAHooks(at::CUDAHooksArgs) {}
  bool hasCUDA() const override { return true; }
  bool isBuilt() const override { return true; }
  bool isAvailable() const override { return true; }
  bool hasPrimaryContext(c10::DeviceIndex) const override { return true; }
  void init() const override {}
  c10::DeviceIndex deviceCount() const override { return 8; }
  c10::DeviceIndex getCurrentDevice() const override { return 0; }
  void setCurrentDevice(c10::DeviceIndex) const override {}
  c10::DeviceIndex exchangeDevice(c10::DeviceIndex) const override { return 0; }
  c10::DeviceIndex maybeExchangeDevice(c10::DeviceIndex) const override { return 0; }
  bool isPinnedPtr(const void*) const override { return false; }
};

}  // namespace megatron_core_dry_run

namespace c10::impl {
C10_REGISTER_GUARD_IMPL(CUDA, FakeGuardImpl<DeviceType::CUDA>);
}
namespace at {
C10_REGISTER_CLASS(CUDAHooksRegistry, CUDAHooks, megatron_core_dry_run::FakeCUDAHooks);
}
