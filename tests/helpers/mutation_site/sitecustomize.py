"""`make mutation` only (this directory is on its PYTHONPATH, never on a test run's).

mutmut learns which tests reach a function from the "trampoline hits" it records in the test
process. The multi-process tests reach most of comm/, loader/ and llamafactory/ in child
processes (gloo ranks forked from a forkserver, torchrun workers, DataLoader workers), whose hits
would be lost with them: without this, mutmut would find no test for those functions. Here every
Python process started while mutmut collects its statistics appends each function it reaches to
``$ODB_MUTATION_HITS/<pid>.hits`` at once (forked children end with os._exit, so nothing can wait
for the exit); tests/conftest.py credits the files to the test that was running.
"""

import os

if os.environ.get("MUTANT_UNDER_TEST") == "stats" and os.environ.get("ODB_MUTATION_HITS"):
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

    _trampoline.record_trampoline_hit = _record_hit
