"""The configuration: the settings table (:mod:`.settings`: every setting once, with its flag),
the loader of ``config.json`` and its checks (:mod:`.load`), the ``TINY_MINDIE_*`` environment
(:mod:`.env`) and the TLS files a configuration names (:mod:`.tls`)."""
