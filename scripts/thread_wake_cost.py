"""What a torch thread pool costs for one vocabulary row's CPU work after the process has waited.

Beside a GPU model, a service's CPU work per token is a few operations on one row of logits, each
after a wait (for the GPU, for the next request). Usage: ``python scripts/thread_wake_cost.py``.
"""

import sys
import time

import torch


def row_work(x: torch.Tensor) -> None:
    y = torch.softmax(x * 1.0001, -1)
    int(y.argmax())
    float(y.sum())
    torch.topk(x, 20)


def main(threads_list=(1, 2), wait_s: float = 0.018, n: int = 200) -> None:
    x = torch.randn(1, 49152)
    for threads in threads_list:
        torch.set_num_threads(threads)
        for _ in range(20):
            row_work(x)
        times = []
        for _ in range(n):
            time.sleep(wait_s)
            t = time.perf_counter()
            row_work(x)
            times.append(time.perf_counter() - t)
        times.sort()
        print(f"{threads} thread(s): row work after a {wait_s * 1e3:.0f} ms wait: p50 {times[n // 2] * 1e3:.2f} ms, "
              f"p90 {times[n * 9 // 10] * 1e3:.2f} ms, mean {sum(times) / n * 1e3:.2f} ms")


if __name__ == "__main__":
    main(tuple(int(a) for a in sys.argv[1:]) or (1, 2))
