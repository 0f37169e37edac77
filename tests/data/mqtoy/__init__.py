"""An out-of-tree mq backend, ``toy``, for tests/test_plugin.py: everything mq knows about it is
this package's ``BACKEND``, registered in the ``mq.backends`` entry-point group; no line of mq
names it. Its transport is nng's, held to TCP between processes (routes ``inproc`` and ``tcp``),
with one option of its own (``motto``), which ``mq run`` offers as ``--motto``."""

from functools import partial

from mq.backend import Backend, ConformanceCase, Flag
from mq.backends.nng.launch import NngLaunch
from mq.options import check_choice

MOTTOS = ("plain", "loud")

BACKEND = Backend(
    name="toy",
    mq_types={"toy": {"protocol": "tcp"}},
    transport="mqtoy.transport:ToyTransport",
    options="mqtoy.transport:ToyOptions",
    routes=frozenset({"inproc", "tcp"}),
    summary="a test's backend: nng held to TCP",
    data_paths=frozenset(),  # held to TCP: no shared-memory descriptors either
    launch=NngLaunch(),
    flags=(Flag("motto", metavar="|".join(MOTTOS), check=partial(check_choice, name="motto", choices=MOTTOS)),),
    trust="mqtoy.transport:TRUST",
    doctor="mqtoy.transport:doctor_section",
    conformance=(ConformanceCase("toy-tcp", "toy", "tcp", {"motto": "loud"}),),
)
