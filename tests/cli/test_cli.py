"""The ``mpicoll`` command line: ``info``, usage errors in one line, help for every option, one name per choice."""

from __future__ import annotations

import pytest

from tests.support.jobs import launch


def test_info_reports_mpi_and_auto_rules():
    result = launch(2, "-m", "mpicoll", "info")
    assert result.returncode == 0, result.stderr
    assert "mpi4py" in result.stdout and "ranks      2" in result.stdout and ("allreduce: shm\n" in result.stdout
                                                                       or "allreduce: mpi below" in result.stdout)
    assert "allgather (across nodes of several ranks): mpi below 131072 B, hierarchical" in result.stdout
    assert "kernels    numpy: available" in result.stdout and "CUDA-aware " in result.stdout and "GPU " in result.stdout


@pytest.mark.parametrize("args, words", [(["train", "--epocs", "3"], "unrecognized arguments: --epocs 3 (did you "
                                                                       "mean --epochs?)"),
                                         (["train", "--epochs", "x"], "argument --epochs: invalid int value: 'x'"),
                                         (["trian"], "invalid choice: 'trian'")])
def test_a_usage_error_is_one_line_per_job_not_one_usage_per_rank(args, words):
    result = launch(4, "-m", "mpicoll", *args)
    lines = (result.stdout + result.stderr).splitlines()
    assert result.returncode == 2 and len(lines) == 1, lines
    assert words in lines[0] and lines[0].endswith("--help"), lines


def test_every_option_of_every_command_says_what_it_does():
    import argparse
    from mpicoll.cli import make_parser

    def silent(parser, name):
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for word, sub in action.choices.items():
                    yield from silent(sub, f"{name} {word}")
            elif not action.help:
                yield f"{name} {'/'.join(action.option_strings) or action.dest}"

    assert list(silent(make_parser(), "mpicoll")) == []


def test_one_option_chooses_how_ranks_exchange_for_parameter_servers_and_gossip():
    """--transport is the one name for p2p or onesided (parameter servers and SGP alike); --mailbox, SGP's old
    name for it, sets the same thing."""
    from mpicoll.cli import make_parser
    from mpicoll.train import Options
    parse = make_parser().parse_args
    for words, expected in [([], "p2p"), (["--transport", "onesided"], "onesided"), (["--mailbox", "onesided"],
                                                                                    "onesided")]:
        options = Options.from_args(parse(["train", "--method", "sgp", *words]))
        assert options.transport == expected and not hasattr(options, "mailbox"), words


def test_a_crash_inside_a_command_under_mpiexec_prints_where_python_was():
    """A segmentation fault in native code (MPICH's UCX transport crashed a parameter server once in CI, leaving only
    the shell's "Segmentation fault") prints each Python thread's stack, the function that crashed in it."""
    crash = ("import argparse, ctypes\n"
             "from mpicoll import cli\n"
             "def read_address_zero(args):\n"
             "    return ctypes.string_at(0)\n"
             "cli._guarded(read_address_zero, argparse.Namespace(command='train'))\n")
    result = launch(1, "-c", crash, env={"MPICOLL_END_BROKEN_JOBS": "0"})
    assert result.returncode != 0
    assert "Fatal Python error: Segmentation fault" in result.stderr and "read_address_zero" in result.stderr, \
        result.stderr[-2000:]
