"""course_lib.env decides the device once and sets Triton's mode before any kernel exists."""

import os
import subprocess
import sys
import warnings

import torch

from course_lib import env


def test_device_matches_torch() -> None:
    assert torch.cuda.is_available() == env.HAS_GPU
    assert env.DEVICE.type == ("cuda" if env.HAS_GPU else "cpu")


def test_interpreter_is_on_exactly_when_there_is_no_gpu() -> None:
    if not env.HAS_GPU:
        assert os.environ["TRITON_INTERPRET"] == "1" and env.INTERPRET


def test_env_is_set_before_triton_is_imported() -> None:
    # A fresh interpreter: importing env first must leave Triton in interpreter mode on a CPU machine.
    code = "from course_lib import env; import os; print(os.environ.get('TRITON_INTERPRET'), env.HAS_GPU)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    flag, has_gpu = out.stdout.split()
    assert (flag == "1") == (has_gpu == "False")
    assert out.stderr == "", f"importing course_lib.env wrote to stderr: {out.stderr!r}"


def test_pick_chooses_by_device() -> None:
    assert env.pick(cpu=1, gpu=2) == (2 if env.HAS_GPU else 1)


def test_seed_everything_repeats_draws() -> None:
    env.seed_everything(123)
    a = torch.randn(4)
    env.seed_everything(123)
    assert torch.equal(a, torch.randn(4))


def test_banner_names_device_torch_and_triton() -> None:
    line = env.banner()
    assert "\n" not in line
    assert torch.__version__ in line and "triton" in line
    assert ("interpreter" in line) == env.INTERPRET or "not installed" in line


def test_known_warnings_are_silenced() -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")
        env.quiet_warnings()
        # stacklevel=1 (the default): the warnings are attributed to this module, as a library's own would be to it.
        warnings.warn("This DataLoader will create 4 worker processes ... does not have many workers", UserWarning, stacklevel=1)
        # a library's own deprecation notice: attributed to a torch module
        warnings.warn_explicit("old api", DeprecationWarning, "torch/old.py", 1, module="torch.old")
    assert caught == []


def test_deprecations_caused_by_the_students_code_still_show() -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")
        env.quiet_warnings()
        warnings.warn_explicit("my_helper is deprecated", DeprecationWarning, "<ipython-input-3>", 2, module="__main__")
        warnings.warn_explicit("old course helper", DeprecationWarning, "course_lib/x.py", 5, module="course_lib.x")
    assert [str(w.message) for w in caught] == ["my_helper is deprecated", "old course helper"]
