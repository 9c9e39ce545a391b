"""What a long-lived process (a web worker, a Celery worker) does once it has started."""

from __future__ import annotations

import gc


def freeze_startup_objects() -> None:
    """Put what the process built to start (modules, the app, its settings, pools and
    clients: most of its objects) out of the garbage collector's reach.

    A full collection walks every tracked object; it runs every few thousand requests or
    runs, and would walk the start-up objects each time, though they live as long as the
    process. Frozen, they are never collected (they were not going to be), and a full
    collection walks only what the work made since."""
    gc.collect()
    gc.freeze()
