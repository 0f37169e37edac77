"""A two-worker pool whose second worker starts :data:`LATE_S` after the first, as a slow spawn on a
loaded host does (every spawned worker imports torch and DI-engine before it runs anything).

Each spawned worker imports this module when it unpickles its main function; with
``MQ_TEST_LATE_START`` naming a folder, the first importer takes a marker file there and every
later one sleeps. The main is DI-engine's ``parallel_main`` (test_parallel.py): each worker emits
for about 1.6 s after it starts ``main`` and fails unless it hears the other, so it passes only
when both begin ``main`` together, whenever their processes started.
"""

import os
import time

LATE_S = 2.5

_marker_dir = os.environ.get("MQ_TEST_LATE_START")
if _marker_dir:
    try:
        os.close(os.open(os.path.join(_marker_dir, "first"), os.O_CREAT | os.O_EXCL))
    except FileExistsError:
        time.sleep(LATE_S)


def late_main():
    from tests.ding_jobs.scenarios import parallel_main

    parallel_main()
