

def record_pid(ctx) -> None:
    """Write this worker's pid to ``<pid_dir>/<node>.pid`` (args or MQ_TEST_PID_DIR), atomically:
    a test reading the folder never sees a half-written file."""
    import os

    out = ctx.args.get("pid_dir") or os.environ.get("MQ_TEST_PID_DIR")
    if out:
        tmp = os.path.join(out, f".{ctx.node_id}.pid.tmp")
        with open(tmp, "w") as f:
            f.write(str(os.getpid()))
        os.replace(tmp, os.path.join(out, f"{ctx.node_id}.pid"))


def say(line: str) -> None:
    """One write per line: a host's workers share the launcher's stdout, and print() writes the
    newline separately when Python runs unbuffered, so lines of two workers could interleave."""
    import os

    os.write(1, (line + "\n").encode())
