"""A Ray Compiled Graph built and torn down, again and again, against one actor: how many entries
and bytes each build leaves in /dev/shm while Ray runs (docs/performance.md#soak). Ray alone, no
knnlm-serve code: the reproduction for Ray's issue tracker.

    .venv/bin/python loadtest/graph_rebuild_leak.py --builds 8
"""

from __future__ import annotations

import argparse
import gc
import os
import time

import numpy as np
import ray
from ray.dag import InputNode

SHM = "/dev/shm"


def shm_usage() -> tuple[int, int]:
    """(entries, bytes allocated) in /dev/shm."""
    entries = os.listdir(SHM)
    size = 0
    for name in entries:
        try:
            size += os.stat(os.path.join(SHM, name)).st_blocks * 512
        except FileNotFoundError:
            pass
    return len(entries), size


@ray.remote(num_cpus=0)
class Echo:
    def step(self, batch):
        return np.zeros((batch.shape[0], 4), np.float32)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--builds", type=int, default=8)
    parser.add_argument("--buffer-mib", type=int, default=16, help="the channels' first buffer (knnlm-serve uses 16 MiB)")
    args = parser.parse_args()
    ray.init(include_dashboard=False, log_to_driver=False, namespace="graph-rebuild-leak")
    actor = Echo.remote()
    ray.get(actor.__ray_ready__.remote())
    start = shm_usage()
    print(f"ray {ray.__version__}: /dev/shm {start[0]} entries, {start[1] / 2**20:.0f} MiB")
    for build in range(1, args.builds + 1):
        with InputNode() as step:
            graph = actor.step.bind(step).experimental_compile(_buffer_size_bytes=args.buffer_mib * 2**20)
        graph.execute(np.zeros((1, 8), np.float32)).get(timeout=60)
        graph.teardown()
        del graph, step  # no reference left on our side
        gc.collect()
        time.sleep(0.5)
        entries, size = shm_usage()
        print(f"after build {build}: +{entries - start[0]} entries, +{(size - start[1]) / 2**20:.0f} MiB")
    ray.shutdown()
    time.sleep(1)
    entries, size = shm_usage()
    print(f"after ray.shutdown(): +{entries - start[0]} entries, +{(size - start[1]) / 2**20:.0f} MiB")


if __name__ == "__main__":
    main()
