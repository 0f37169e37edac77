"""raw3.py recv|send ADDR PORT SIZE_MB N ; env SCHUNK RCHUNK (0 = whole)"""
import socket, sys, time, os
import numpy as np
role, addr, port = sys.argv[1], sys.argv[2], int(sys.argv[3])
size = int(float(sys.argv[4]) * (1 << 20)); n = int(sys.argv[5])
SC = int(os.environ.get("SCHUNK", 0)) or size; RC = int(os.environ.get("RCHUNK", 0)) or size
if role == "recv":
    srv = socket.socket(); srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); srv.bind((addr, port)); srv.listen(1)
    c, _ = srv.accept(); c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1); c.settimeout(60)
    buf = bytearray(size); mv = memoryview(buf)
    for i in range(n):
        got = 0
        while got < size:
            got += c.recv_into(mv[got:min(size, (got // RC + 1) * RC)])
        c.sendall(b"k")
    sys.exit(0)
payload = np.ones(size, np.uint8); mv = memoryview(payload)
s = socket.create_connection((addr, port)); s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1); s.settimeout(60)
times = []
for i in range(n):
    t0 = time.perf_counter()
    for o in range(0, size, SC): s.sendall(mv[o:o + SC])
    s.recv(1); times.append(time.perf_counter() - t0)
ms = sorted(t * 1e3 for t in times[1:])
print(f"S{SC>>10}K R{RC>>10}K p50 {ms[len(ms)//2]:.1f}:", " ".join(f"{t*1e3:.0f}" for t in times))
