"""Facts of this machine and this install: the CPU's features and cores (`cpu`), the devices and where a
model computes (`devices`), the versions of installed packages (`versions`)."""
