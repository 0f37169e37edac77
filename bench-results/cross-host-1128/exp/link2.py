"""mq's tcp link alone (Outbound -> Inbound, no mq node) across the veth:
link2.py recv|send ADDR PORT SIZE_MB N (receiver first; PIECE env overrides the piece size)."""
import os, select, socket, sys, time
import numpy as np
from mq.backends.links import tcp
from mq.codec import Codec, MSG
tcp.PIECE = int(os.environ.get("PIECE", tcp.PIECE))
role, addr, port = sys.argv[1], sys.argv[2], int(sys.argv[3])
size = int(float(sys.argv[4]) * (1 << 20)); n = int(sys.argv[5])
if role == "recv":
    srv = socket.socket(); srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); srv.bind((addr, port)); srv.listen(1)
    print("ready", flush=True)
    c, _ = srv.accept()
    inb = tcp.Inbound(c, 1 << 40, lambda l: True)
    p = select.poll(); p.register(c.fileno(), select.POLLIN)
    got = 0
    while got < n:
        p.poll()
        f = inb.read()
        while f is not None:
            got += 1
            del f
            os.write(c.fileno(), b"k")
            f = inb.read() if got < n else None
    sys.exit(0)
payload = np.ones(size - 200, np.uint8)
out = tcp.Outbound(f"tcp://{addr}:{port}", 5, lambda: None)
codec = Codec(); times = []
for i in range(n):
    frame = codec.encode(MSG, "t", 0, i, 0, payload)
    t0 = time.perf_counter(); out.send(1, frame, 30)
    sel = select.poll(); sel.register(out.fd, select.POLLIN); sel.poll(); out.sock.recv(1)
    times.append(time.perf_counter() - t0)
ms = sorted(t * 1e3 for t in times[1:])
print(f"link p50 {ms[len(ms)//2]:.1f} end {time.time()%1000:.1f}:", " ".join(f"{t*1e3:.0f}" for t in times))
