"""The nvlink data path (route ``nvlink``): CUDA IPC pools on one host (:mod:`.cuda_ipc`),
offered and read by :mod:`.path`."""
