"""Progress bars (tqdm) for the long-running tools: preprocessing, tokenizer training, checkpoint conversion
and evaluation. Drawn on stderr only when it is a terminal and the caller did not turn them off (the tools'
``--no-progress``), so logs and CI output stay clean."""
from __future__ import annotations

import sys
from typing import Iterable, Optional

from tqdm import tqdm


def progress_bar(iterable: Optional[Iterable] = None, *, total: Optional[int] = None, desc: str = "",
                 unit: str = "it", enabled: bool = True, **kwargs) -> tqdm:
    """A ``tqdm`` bar on stderr, disabled (a no-op that still counts) unless ``enabled`` and stderr is a TTY."""
    return tqdm(iterable, total=total, desc=desc, unit=unit, file=sys.stderr, dynamic_ncols=True,
                disable=not (enabled and sys.stderr.isatty()), **kwargs)
