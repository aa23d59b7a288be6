"""What runs beside the daemon: ``bench/``, ``replay/`` (the eviction simulator),
``fsck`` and the end-to-end ``demo``."""
