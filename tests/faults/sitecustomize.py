"""Fault injection for the reliability tests' server processes (they put this directory on PYTHONPATH).

With INFOKV_TEST_PAUSE_SAVE=<marker path>, a cache save of a document whose text contains
`PAUSE-THIS-SAVE` stops half-way (its tensors and text written, not its manifest): it creates the marker
file and sleeps, so that the test can SIGKILL the server inside the save. Other saves run normally, and
nothing happens at all without the variable.
"""

import os

_MARKER = os.environ.get("INFOKV_TEST_PAUSE_SAVE")
TRIGGER = b"PAUSE-THIS-SAVE"

if _MARKER:
    import time
    from pathlib import Path

    from infokv_rag import store

    _write_synced = store.write_synced  # the store's own name for `infokv_rag.files.write_synced`
    _marker = Path(_MARKER)

    def _paused_write(path: Path, data: bytes) -> None:
        _write_synced(path, data)
        if Path(path).name == store.TEXT and TRIGGER in data:
            _marker.touch()
            time.sleep(3600)

    store.write_synced = _paused_write
