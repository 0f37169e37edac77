"""mq's own links: sockets read by the receiving thread itself, one hop per frame where NNG's
sockets take three. The nng transport carries its frames on them by default (``unix_links``,
``tcp_links``) and keeps NNG for joining and for the cases they cannot serve.

- :mod:`~mq.backends.nng.links.base`: the listener and the sending/receiving halves every link shares.
- :mod:`~mq.backends.nng.links.unix`: unix SEQPACKET on one host (routes ``shm`` and ``ipc``).
- :mod:`~mq.backends.nng.links.tcp`: TCP records between hosts (route ``tcp``).
"""
