"""The memory plan (``dsrl-train --plan``): what each phase of a run holds on the device and the host. No torch."""
