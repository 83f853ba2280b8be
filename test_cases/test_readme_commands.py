"""The README's commands are true: every command line of its bash blocks is classified by an explicit
rule; those that run on the CPU in seconds (tiny configs) are run and must write what they promise;
every runnerkit flag any command uses exists in the parser it reaches; the flag tables list every flag.

A new command that no rule matches fails `test_every_command_is_classified`, so none is silently ignored.
"""

from __future__ import annotations

import json
import re
import shlex
from dataclasses import dataclass
from pathlib import Path

import pytest
from safetensors import safe_open

from runnerkit.infer import build_parser
from runnerkit.serve.server import build_parser as build_serve_parser
from runnerkit.tools.plan import build_parser as build_plan_parser
from test_cases._cli import no_gc_freeze, restore_logger  # noqa: F401 (autouse fixtures)

REPO = Path(__file__).resolve().parents[1]
README = (REPO / "README.md").read_text()

#: Config names that stand for a config of the reader's own (the torchrun example's `parallel` config).
READER_CONFIGS = {"my_config.json"}

#: Flags whose value is a file the command writes: the test redirects them into its tmp folder.
OUTPUT_FLAGS = ("--save_result_path", "--save_tensor_path", "--profile_json")


@dataclass(frozen=True)
class Command:
    """One command of a README bash block: its tokens (shell quoting removed) and where it sits."""

    argv: tuple[str, ...]
    line: int

    @property
    def text(self) -> str:
        return shlex.join(self.argv)


def bash_commands(text: str) -> list[Command]:
    """Every command of every ```bash block: continuation lines joined, comments dropped, `&&` chains split."""
    commands: list[Command] = []
    for block in re.finditer(r"^```bash\n(.*?)^```", text, flags=re.S | re.M):
        first_line = text.count("\n", 0, block.start(1)) + 1
        logical: list[tuple[int, str]] = []  # (README line of its first physical line, joined text)
        pending, start = "", first_line
        for k, raw in enumerate(block.group(1).splitlines()):
            if not pending:
                start = first_line + k
            if raw.rstrip().endswith("\\"):
                pending += raw.rstrip()[:-1] + " "
                continue
            logical.append((start, pending + raw))
            pending = ""
        for line, source in logical:
            tokens = shlex.split(source, comments=True)
            chain: list[str] = []
            for token in [*tokens, "&&"]:
                if token == "&&":
                    if chain:
                        commands.append(Command(tuple(chain), line))
                    chain = []
                else:
                    chain.append(token)
    return commands


def runnerkit_args(argv: tuple[str, ...]) -> tuple[str, ...] | None:
    """The launch script's arguments of a command that starts it (`runnerkit`, `python -m runnerkit.infer`,
    `torchrun ... -m runnerkit.infer`), `serve` first for the server; None for any other command."""
    if argv[0] == "runnerkit":
        return argv[1:]
    for k in range(len(argv) - 1):
        if argv[k] == "-m" and argv[k + 1] == "runnerkit.infer":
            return argv[k + 2:]
    return None


def flag_value(args: tuple[str, ...], flag: str) -> str | None:
    return args[args.index(flag) + 1] if flag in args else None


def is_tiny(args: tuple[str, ...]) -> bool:
    config = flag_value(args, "--config_json")
    return config is not None and re.fullmatch(r"configs/[^/]+/[^/]*tiny[^/]*\.json", config) is not None


#: (name, matches, skip reason or None to run). Checked in order; the first that matches decides.
RULES: list[tuple[str, object, str | None]] = [
    ("setup", lambda a: a[:3] == ("python3", "-m", "venv") or a[0] in (".", "source") or a[:2] == ("pip", "install"),
     "environment setup: the test runs in the installed environment"),
    ("test suite", lambda a: a[:3] == ("python", "-m", "pytest"), "the test suite itself (.ci/run runs it)"),
    ("http client", lambda a: a[0] == "curl", "talks to a running `runnerkit serve` (test_cases/serve covers the API)"),
    ("torchrun", lambda a: a[0] == "torchrun",
     "a process group of several ranks (docs/multi_gpu.md; test_cases/parallel); flags checked below"),
    ("server", lambda a: (r := runnerkit_args(a)) is not None and r[:1] == ("serve",),
     "a long-running server (test_cases/serve starts and stops one); flags checked below"),
    ("plan", lambda a: (r := runnerkit_args(a)) is not None and r[:1] == ("plan",), None),
    ("tiny run", lambda a: (r := runnerkit_args(a)) is not None and is_tiny(r), None),
    ("real checkpoint", lambda a: (r := runnerkit_args(a)) is not None and not is_tiny(r),
     "a config of real sizes: a CUDA GPU and downloaded weights"),
]


def classify(command: Command) -> tuple[str, str | None] | None:
    for name, matches, reason in RULES:
        if matches(command.argv):  # type: ignore[operator]
            return name, reason
    return None


COMMANDS = bash_commands(README)
CLASSIFIED = [(c, classify(c)) for c in COMMANDS]


def test_readme_has_commands_of_every_kind() -> None:
    kinds = {rule[0] for _, rule in CLASSIFIED if rule is not None}
    assert {"setup", "test suite", "tiny run", "server", "plan", "real checkpoint"} <= kinds, kinds
    assert len(README.splitlines()) < 450, "the README is a reader's document: details go to docs/"


def test_every_command_is_classified() -> None:
    unclassified = [f"README.md:{c.line}: {c.text}" for c, rule in CLASSIFIED if rule is None]
    assert unclassified == [], "commands no rule of RULES matches:\n" + "\n".join(unclassified)


RUNNERKIT_COMMANDS = [c for c in COMMANDS if runnerkit_args(c.argv) is not None]


@pytest.mark.parametrize("command", RUNNERKIT_COMMANDS, ids=lambda c: f"line{c.line}")
def test_flags_exist_and_files_are_in_the_repo(command: Command) -> None:
    args = runnerkit_args(command.argv)
    assert args is not None
    sub = args[:1] if args[:1] in (("serve",), ("plan",)) else ()
    parser = {("serve",): build_serve_parser, ("plan",): build_plan_parser}.get(sub, build_parser)()
    try:
        parsed = parser.parse_args(list(args[len(sub):]))
    except SystemExit as exc:  # argparse prints the unknown or malformed flag to stderr
        pytest.fail(f"README.md:{command.line}: the parser refuses `{command.text}` (exit {exc.code})")
    if parsed.config_json not in READER_CONFIGS:
        assert (REPO / parsed.config_json).is_file(), f"README.md:{command.line}: no config {parsed.config_json}"
    for flag in ("image_path", "last_frame_path"):
        if (path := getattr(parsed, flag, None)) is not None:
            assert (REPO / path).is_file(), f"README.md:{command.line}: no {flag} {path}"
    for path in getattr(parsed, "extra_image_paths", None) or []:
        assert (REPO / path).is_file(), f"README.md:{command.line}: no extra image {path}"


def _table_flags(section: str) -> set[str]:
    body = README.split(f"## {section}\n", 1)[1].split("\n## ", 1)[0]
    rows = [line.split("|")[1] for line in body.splitlines() if line.startswith("| `")]
    return {flag for row in rows for flag in re.findall(r"--?[a-z_]+", row)}


def _parser_flags(parser: object) -> set[str]:
    return {s for action in parser._actions for s in action.option_strings}  # type: ignore[attr-defined]


def test_command_line_table_lists_every_flag_of_the_launch_script() -> None:
    assert _table_flags("Command line") == _parser_flags(build_parser())


def test_plan_section_lists_every_flag_of_plan() -> None:
    body = README.split("## What will run on my machine?\n", 1)[1].split("\n## ", 1)[0]
    bullet = body.split("- **Flags**", 1)[1].split("\n- ", 1)[0]
    assert set(re.findall(r"--[a-z_]+", bullet)) == _parser_flags(build_plan_parser()) - {"-h", "--help"}


def test_server_section_lists_every_flag_of_the_server() -> None:
    body = README.split("## HTTP server\n", 1)[1].split("\n## ", 1)[0]
    bullet = body.split("- **Flags**", 1)[1].split("\n- ", 1)[0]
    assert set(re.findall(r"--[a-z_]+", bullet)) == _parser_flags(build_serve_parser()) - {"-h", "--help"}


def _redirect(args: tuple[str, ...], out: Path) -> tuple[list[str], list[Path]]:
    """`args` with every output path moved into `out` (same file name), and the files they promise."""
    argv, promised = list(args), []
    for flag in OUTPUT_FLAGS:
        if flag in argv:
            k = argv.index(flag) + 1
            argv[k] = str(out / Path(argv[k]).name)
            promised.append(Path(argv[k]))
            if flag == "--save_result_path":
                promised.append(Path(argv[k]).with_suffix(".json"))  # the sidecar
    return argv, promised


def _audio_samples(frames: int, fps: int, sample_rate: int) -> int:
    """LTX-2's audio length as docs/ltx2.md states it: L = round(25 frames / fps) latents decode into
    4L - 3 mel frames of 10 ms."""
    latents = round(25 * frames / fps)
    return (4 * latents - 3) * sample_rate // 100


def _run(capsys: pytest.CaptureFixture[str], argv: list[str]) -> tuple[int, str, str]:
    """The `runnerkit` console script's entry point (`runnerkit.cli.main`) called in this process, from
    the repository root: (exit status, stdout, stderr). What a command promises (files, printed text,
    exit status) is the entry point's, not the interpreter's start-up (test_infer.py starts real ones)."""
    from runnerkit.cli import main

    capsys.readouterr()
    rc = main(argv)
    out, err = capsys.readouterr()
    return rc, out, err


@pytest.mark.parametrize("entry", CLASSIFIED, ids=lambda e: f"line{e[0].line}-{e[1][0] if e[1] else 'unclassified'}")
def test_readme_command(entry: tuple[Command, tuple[str, str | None] | None], tmp_path: Path,
                        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    command, rule = entry
    if rule is None:
        pytest.fail(f"README.md:{command.line}: unclassified command {command.text}")
    name, reason = rule
    if reason is not None:
        pytest.skip(f"{name}: {reason}")
    args = runnerkit_args(command.argv)
    assert args is not None
    monkeypatch.chdir(REPO)
    if name == "plan":  # no checkpoint needed: it prints the plan of the config's architecture
        assert not (REPO / json.loads((REPO / flag_value(args, "--config_json")).read_text())["model_path"]).exists()
        rc, out, err = _run(capsys, list(args))
        assert rc == 0, f"README.md:{command.line}: exit {rc}\n{err[-3000:]}"
        shown = re.search(r"```\n\n```\n(.*?)```", README.split(command.text, 1)[1], flags=re.S).group(1)
        assert set(shown.splitlines()) <= set(out.splitlines()), out  # the README's excerpt is true
        return
    argv, promised = _redirect(args, tmp_path)
    assert promised, f"README.md:{command.line}: a command that promises no output file"
    rc, _, err = _run(capsys, argv)
    assert rc == 0, f"README.md:{command.line}: exit {rc}\n{err[-3000:]}"
    missing = [str(p) for p in promised if not p.is_file() or p.stat().st_size == 0]
    assert missing == [], f"README.md:{command.line}: promised files not written: {missing}"
    result = flag_value(tuple(argv), "--save_result_path")
    sidecar = json.loads(Path(result).with_suffix(".json").read_text()) if result else {}
    if flag_value(args, "--config_json") == "configs/wan/wan_t2v_tiny.json":  # the Quick start's stated result
        import imageio.v3 as iio

        h, w, f = map(int, re.search(r"height×width (\d+)×(\d+), (\d+) frames", README).groups())
        assert (sidecar["height"], sidecar["width"], sidecar["frames"]) == (h, w, f)
        assert iio.imread(result).shape == (f, h, w, 3)
    streams = sidecar.get("streams", {})
    if "audio" in streams:
        video, audio = streams["video"], streams["audio"]
        expected = _audio_samples(video["frames"], video["fps"], audio["sample_rate"])
        assert audio["samples"] == expected
        tensors = flag_value(tuple(argv), "--save_tensor_path")
        if tensors:
            with safe_open(tensors, "pt") as f:
                assert f.get_slice("audio").get_shape() == [audio["channels"], expected]


def test_relative_links_point_to_files_in_the_repo() -> None:
    links = re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", README)
    assert links, "the README links its docs"
    assert [link for link in links if not (REPO / link).exists()] == []
