"""The compute-sanitizer stage's script (benchmarks/sanitize_cases.py) launches every kernel
instantiation the op modules declare: run it (on a GPU, or on the CPU emulator) and check that
nothing declared was left out. emu_slow: on the emulator it builds and runs all of them."""
import pytest


@pytest.mark.gpu
@pytest.mark.emu_slow
def test_sanitize_cases_launch_every_instantiation():
    from benchmarks import sanitize_cases

    sanitize_cases.run()
    assert sanitize_cases.missing() == []
