"""`hpdl vision` rejects counts that make no sense instead of replacing them by the defaults."""

import pytest

pytest.importorskip("torchvision")


@pytest.mark.parametrize("argv", [
    ["--model", "soft_tiny", "--batch-size", "0"],
    ["--model", "sprnet", "--batch-size", "-2"],
    ["--model", "sprnet", "--image-size", "0"],
    ["--model", "soft_tiny", "--epochs", "0"],
    ["--model", "soft_tiny", "--max-steps", "0"],
    ["--model", "soft_tiny", "--workers", "-1"],
    ["--model", "soft_tiny", "--image-size", "x"],
])
def test_bad_counts_are_usage_errors(argv, capsys):
    from hpdl.cli import main

    flag = argv[2]
    with pytest.raises(SystemExit) as exc:
        main(["vision", "train", *argv])
    assert exc.value.code == 2
    assert flag in capsys.readouterr().err


def test_good_counts_parse():
    from hpdl.cli import build_parser

    args = build_parser("vision").parse_args(["vision", "train", "--model", "sprnet", "--batch-size", "2",
                                              "--workers", "0", "--image-size", "64", "--max-steps", "3"])
    assert (args.batch_size, args.workers, args.image_size, args.max_steps) == (2, 0, 64, 3)


@pytest.mark.parametrize("flag, value", [("--lr", "-1"), ("--lr", "0"), ("--lr", "nan"), ("--weight-decay", "-1"),
                                         ("--warmup-epochs", "-1"), ("--clip-grad", "-1"), ("--seed", "-1"),
                                         ("--pictures", "-1"), ("--fpn-channels", "0")])
def test_bad_numbers_are_usage_errors(flag, value, tmp_path, capsys):
    """A negative clip switched clipping off and a negative warm-up meant none, silently; --pictures -1 or 0
    crashed after training, before the metrics were written; --fpn-channels 0 failed in a conv's init."""
    from hpdl.cli import main

    with pytest.raises(SystemExit) as exc:
        main(["vision", "train", "--model", "sprnet", "--data", str(tmp_path / "none"), "--device", "cpu",
              "--out", str(tmp_path / "o"), flag, value])   # where a missed check fails fast, not trains
    assert exc.value.code == 2
    assert flag in capsys.readouterr().err


def test_evaluate_names_the_model_a_checkpoint_of_the_other_task_holds(tmp_path, capsys):
    """Issue 37 item 9: `evaluate --model soft_tiny` on SPRNet's checkpoint said "not a checkpoint written by hpdl
    vision train" (it is); both directions must name the model the file holds and the --model to use."""
    import torch

    from hpdl.cli import main

    det = tmp_path / "sprnet.pt"
    torch.save({"format": "hpdl.vision.detect/1", "spec": {"name": "sprnet", "num_classes": 3}, "meta": {},
                "state_dict": {}}, det)
    assert main(["vision", "evaluate", "--model", "soft_tiny", "--checkpoint", str(det), "--device", "cpu"]) == 1
    err = capsys.readouterr().err
    assert "'sprnet'" in err and "--model sprnet" in err and "not a checkpoint written" not in err

    cls = tmp_path / "checkpoint.pt"
    torch.save({"model": "soft_tiny", "config": {}, "classes": ["a"], "state_dict": {}}, cls)
    assert main(["vision", "evaluate", "--model", "sprnet", "--checkpoint", str(cls), "--device", "cpu"]) == 1
    err = capsys.readouterr().err
    assert "'soft_tiny'" in err and "--model soft_tiny" in err


@pytest.mark.parametrize("kwargs, field", [({"device": "tpu"}, "device"), ({"workers": -1}, "workers"),
                                           ({"epochs": 0}, "epochs"), ({"lr": -5}, "lr"),
                                           ({"batch_size": "8"}, "batch_size"), ({"augment": "heavy"}, "augment")])
def test_options_from_python_are_checked_as_their_flags(kwargs, field):
    """These reached the training loop when given from Python (only argparse checked them)."""
    from hpdl.runtime.errors import CLIUsageError
    from hpdl.vision import classify, detect

    flag = "--" + field.replace("_", "-")
    with pytest.raises(CLIUsageError, match=rf"^{field} \({flag}\) must be "):
        classify.TrainOptions(model="soft_tiny", **kwargs)
    if field != "augment":
        with pytest.raises(CLIUsageError, match=rf"^{field} \({flag}\) must be "):
            detect.TrainOptions(model="sprnet", **kwargs)
    assert classify.TrainOptions(model="soft_tiny", device="cuda:1", lr=1).lr == 1.0


def test_bad_device_flag_is_a_usage_error(capsys):
    from hpdl.cli import main

    with pytest.raises(SystemExit) as exc:
        main(["vision", "train", "--model", "soft_tiny", "--device", "tpu"])
    assert exc.value.code == 2 and "--device" in capsys.readouterr().err
