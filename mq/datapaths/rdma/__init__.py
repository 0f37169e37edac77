"""The rdma data path (route ``rdma``): registered pools and one-sided pulls through NIXL
(:mod:`.engine`), offered and read by :mod:`.path`; RDMA fork safety (:mod:`.forksafe`)."""
