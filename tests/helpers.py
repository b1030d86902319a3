"""The tests' helpers live in the package (kda_dhu.testing) so that ``python -m kda_dhu``
can run the same CPU check; this module keeps ``from helpers import ...`` working."""

from kda_dhu.testing import GATES, make_inputs, naive_bwd_dhu  # noqa: F401


def run_in_threads(worker, n: int) -> None:
    """Runs ``worker(i)`` for i in range(n), each in its own thread, all at once; fails
    with every exception the workers raised."""
    import threading

    errors = []

    def guarded(i):
        try:
            worker(i)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=guarded, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
