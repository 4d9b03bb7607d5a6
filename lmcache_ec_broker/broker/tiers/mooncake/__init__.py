"""The remote tier's transport on Mooncake Store: ``transport.py`` (client lifecycle, key
listing, deletes; ``MooncakeTier``), ``data_path.py`` (entries between the slab and the
pool, no copy of ours in between) and ``settings.py`` (the settings resolved for the
tier; the keys are checked at config time by ``config_mooncake.py``)."""
