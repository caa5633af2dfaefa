"""The rules a loaded config must meet, grouped by concern; ``dsrl.config.validate`` runs every group."""
