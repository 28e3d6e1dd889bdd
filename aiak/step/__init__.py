"""The training step as the user's loop drives it: the step controller (gradient accumulation, unscaling,
DDP ``no_sync``, clipping, checkpoint state), torch's clip calls routed to it, schedulers stepped once per
real step, and what it needs to know of the frameworks around it (their own accumulation, their optimizer
wrappers)."""
