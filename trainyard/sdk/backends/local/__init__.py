"""The local backend: emulated hosts on this machine (processes, or containers of the training image), a
detached supervisor per job, an emulated network when asked."""
