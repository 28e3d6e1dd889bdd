"""Facts of this machine and this install: the CPU's features and cores (:mod:`.cpu`), the devices and where a
model computes (:mod:`.devices`), the versions of installed packages (:mod:`.versions`)."""
