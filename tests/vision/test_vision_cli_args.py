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
