"""`make mutation` only (this directory is on its PYTHONPATH, never on a test run's).

mutmut learns which tests reach a function from the "trampoline hits" it records in the test
process. The multi-process tests reach most of comm/, loader/ and llamafactory/ in child
processes (gloo ranks forked from a forkserver, torchrun workers, DataLoader workers), whose hits
would be lost with them: without this, mutmut would find no test for those functions. Here every
Python process of the run, the statistics process and whatever it forks or starts, appends each
function it reaches while mutmut collects its statistics to ``$ODB_MUTATION_HITS/<pid>.hits`` at
once (forked children end with os._exit, so nothing can wait for the exit); tests/conftest.py
credits the files to the test that was running. The patch is installed in mutmut's own process
too, before it sets MUTANT_UNDER_TEST: its statistics child is a fork, and so are the DataLoader
workers that child starts.
"""

import os

if os.environ.get("ODB_MUTATION_HITS"):
    import mutmut.mutation.trampoline as _trampoline

    _hits_dir = os.environ["ODB_MUTATION_HITS"]
    _written: dict = {"pid": None, "names": set()}

    def _record_hit(name, caller=None):
        if _written["pid"] != os.getpid():  # a forked child writes its own file
            _written.update(pid=os.getpid(), names=set())
        if name not in _written["names"]:
            _written["names"].add(name)
            with open(os.path.join(_hits_dir, f"{os.getpid()}.hits"), "a") as f:
                f.write(name + "\n")

    def forget_written():
        """The next test starts: write again what this process reaches (conftest calls it)."""
        _written["names"].clear()

    _trampoline.record_trampoline_hit = _record_hit
