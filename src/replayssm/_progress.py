"""Progress bars with an ETA for the long commands (tqdm on stderr, drawn only on a terminal)."""
from __future__ import annotations

import sys


class _Silent:
    def update(self, n=1):
        pass

    def set_description_str(self, text):
        pass

    def close(self):
        pass


def bar(total: int, desc: str, unit: str = "step", enabled: bool | None = None):
    """A progress bar of ``total`` units: ``update(n)``, ``set_description_str(text)``, ``close()``.

    ``enabled`` None draws it when stderr is a terminal; without tqdm nothing is drawn."""
    if enabled is None:
        enabled = sys.stderr.isatty()
    if not enabled:
        return _Silent()
    try:
        from tqdm import tqdm
    except ImportError:
        return _Silent()
    return tqdm(total=total, desc=desc, unit=unit, file=sys.stderr, leave=False)
