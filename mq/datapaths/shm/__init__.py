"""The shm data path (route ``shm``): memfd segments on one host (:mod:`.pool`), offered and
read by :mod:`.path`."""
