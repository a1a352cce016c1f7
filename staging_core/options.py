"""What push and pull are asked to do: StagingOptions, its groups, and the one table the front ends derive from."""
from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

from staging_core.planning.planner import LARGE_FILE_BYTES

if TYPE_CHECKING:
    from staging_core.transports.base import TransportOption

STRATEGIES = ("auto", "individual", "bundle", "hybrid")
STREAM_MODES = ("auto", "on", "off")
CODECS = ("zstd", "gzip", "none")


@dataclass(frozen=True)
class StagingOptions:
    """How to push or pull: one flat record, as callers build it, whose fields fall into five groups, each
    also a typed record (the properties ``planning``, ``routing``, ``far_side``, ``transports``, ``policy``;
    see :data:`OPTION_GROUPS`) and each a section of ``pallet push --help``. ``from_groups`` builds one from
    groups. Every field is declared once in :data:`OPTION_DECLARATIONS`, from which the command line, the
    Snakemake settings and the Parsl provider's keyword arguments are derived.

    strategy      'auto' asks the planner; 'individual', 'bundle', 'hybrid' override it.
    codec         bundle codec (None: the plan's choice, zstd for pulls).
    level         compression level of every shard (None: a stream's level is fitted to the link, a stored
                  bundle's is the codec's default; see staging_core.planning.level).
    shard_size    target uncompressed shard size (None: automatic, see bundles.shards.auto_shard_size).
    large_file_bytes  files at least this big travel individually in a hybrid plan.
    jobs          local worker processes (0: automatic, one per CPU, or none for small work).
    ranks         unpack/pack processes at the far side (``--workers N``, or ``-n N`` for the launcher).
    launcher      command prefix that starts mpi_stager there, e.g. ``mpirun -n 4`` or ``srun -n 64``.
    remote_python Python with pallet installed at the far side.
    ssh_options   extra ssh arguments for every ssh connection pallet opens.
    verify        check every file against the index hash when unpacking.
    profile       link profile name for the planner (None: documented defaults).
    stream        'auto' streams bundles when the transport can, 'on' insists, 'off' stores and forwards.
    unpack_via    ssh URL of a host that sees the destination's file system and unpacks there
                  (for GridFTP and Globus destinations).
    unpack_job    'slurm': submit the unpack as a batch job through ``unpack_via`` and wait for it.
    job_options   extra ``#SBATCH`` lines for the ``unpack.sbatch`` of ``unpack_job`` and ``keep_packed``.
    keep_packed   leave the bundle, its index and an ``unpack.sbatch`` in DEST/.pallet/incoming instead of unpacking.
    pack_via      ssh URL of a host that sees a pull source's file system and packs there.
    retries       attempts after the first for errors marked retryable (network trouble).
    progress      draw per-stage progress on stderr (None: only on a terminal).
    reprobe       probe an ssh far side again instead of using its cached findings (staging_core.far_side.probe).
    delete        after a whole-tree push, remove what DEST holds that the source lacks.
    dry_run       push and pull: list what would be sent or fetched (and deleted), change nothing.
    checksum      when comparing with DEST, also compare by md5 the files whose size, mtime and mode match.
    allow_root_dest  let a whole-tree push's or pull's DEST be '/' or a home directory itself (see
                  ``transports.base.broad_destination``); refused by default (``--allow-root-dest``).
    transport_options  per scheme, keyword arguments for that scheme's transport, among those it declares
                  (``Transport.declared_options``; see ``Transport.options_from``). Data only: a live object
                  (a started connection) goes to the operation's ``early`` argument, never in here.
    """

    strategy: str = "auto"
    codec: str | None = None
    level: int | None = None
    shard_size: int | None = None
    large_file_bytes: int = LARGE_FILE_BYTES
    jobs: int = 0
    ranks: int = 1
    launcher: str | None = None
    remote_python: str = "python3"
    ssh_options: tuple[str, ...] = ()
    verify: bool = True
    profile: str | None = None
    stream: str = "auto"
    unpack_via: str | None = None
    unpack_job: str | None = None
    job_options: tuple[str, ...] = ()
    keep_packed: bool = False
    pack_via: str | None = None
    retries: int = 2
    progress: bool | None = None
    reprobe: bool = False
    delete: bool = False
    dry_run: bool = False
    checksum: bool = False
    allow_root_dest: bool = False
    transport_options: Mapping[str, Mapping[str, Any]] = field(default_factory=dict, hash=False)

    # the groups, each as its own typed record (see OPTION_GROUPS)
    @property
    def planning(self) -> PlanningOptions:
        return _group(self, PlanningOptions)

    @property
    def routing(self) -> RoutingOptions:
        return _group(self, RoutingOptions)

    @property
    def far_side(self) -> FarSideOptions:
        return _group(self, FarSideOptions)

    @property
    def transports(self) -> TransportOptions:
        return _group(self, TransportOptions)

    @property
    def policy(self) -> PolicyOptions:
        return _group(self, PolicyOptions)

    @classmethod
    def from_groups(cls, *groups: OptionGroupRecord) -> StagingOptions:
        """StagingOptions made of option groups (any of PlanningOptions, RoutingOptions, FarSideOptions,
        TransportOptions, PolicyOptions; the defaults for a group not given)."""
        values: dict[str, Any] = {}
        for group in groups:
            values.update({f.name: getattr(group, f.name) for f in dataclasses.fields(group)})
        return cls(**values)

    def with_transport_values(self, values: Iterable[tuple[TransportSetting, Any]]) -> StagingOptions:
        """These options with each ``(setting, value)`` added to ``transport_options[setting.scheme]`` (a
        value given there already for the same name is replaced)."""
        merged = {scheme: dict(given) for scheme, given in self.transport_options.items()}
        for setting, value in values:
            merged.setdefault(setting.scheme, {})[setting.option.name] = value
        return dataclasses.replace(self, transport_options=merged)


# ------------------------------------------------------------------ the groups, each a typed record

@dataclass(frozen=True)
class PlanningOptions:
    """What the planner decides with, and the bundle it makes (see StagingOptions)."""

    strategy: str = "auto"
    codec: str | None = None
    level: int | None = None
    shard_size: int | None = None
    large_file_bytes: int = LARGE_FILE_BYTES
    profile: str | None = None
    jobs: int = 0


@dataclass(frozen=True)
class RoutingOptions:
    """Where and how a bundle is unpacked or packed; each route checks its own (staging_core.routes.registry)."""

    stream: str = "auto"
    unpack_via: str | None = None
    unpack_job: str | None = None
    job_options: tuple[str, ...] = ()
    keep_packed: bool = False
    pack_via: str | None = None


@dataclass(frozen=True)
class FarSideOptions:
    """How pallet runs at the far side."""

    remote_python: str = "python3"
    ranks: int = 1
    launcher: str | None = None
    reprobe: bool = False


@dataclass(frozen=True)
class TransportOptions:
    """What the transports are given: the ssh transport's options, and per scheme the options each transport
    declares (Transport.declared_options)."""

    ssh_options: tuple[str, ...] = ()
    transport_options: Mapping[str, Mapping[str, Any]] = field(default_factory=dict, hash=False)


@dataclass(frozen=True)
class PolicyOptions:
    """What an operation guarantees and shows."""

    verify: bool = True
    retries: int = 2
    progress: bool | None = None
    delete: bool = False
    dry_run: bool = False
    checksum: bool = False
    allow_root_dest: bool = False


OptionGroupRecord = PlanningOptions | RoutingOptions | FarSideOptions | TransportOptions | PolicyOptions
G = TypeVar("G", PlanningOptions, RoutingOptions, FarSideOptions, TransportOptions, PolicyOptions)


def _group(options: StagingOptions, kind: type[G]) -> G:
    return kind(**{f.name: getattr(options, f.name) for f in dataclasses.fields(kind)})


@dataclass(frozen=True)
class OptionGroup:
    """One group of StagingOptions: its property (``attribute``), its record, and its ``--help`` section
    (``title: about``)."""

    attribute: str
    title: str
    about: str
    record: type[OptionGroupRecord]

    @property
    def section(self) -> str:
        return f"{self.title}: {self.about}"


GROUPS: tuple[OptionGroup, ...] = (
    OptionGroup("planning", "planning", "what the planner decides with, and the bundle it makes", PlanningOptions),
    OptionGroup("routing", "routing", "how bundles travel, and where they are unpacked or packed", RoutingOptions),
    OptionGroup("far_side", "far side", "how pallet runs there", FarSideOptions),
    OptionGroup("transports", "transports", "what the transports are given", TransportOptions),
    OptionGroup("policy", "policy", "what is checked, retried and shown", PolicyOptions),
)
OPTION_GROUPS: tuple[type[OptionGroupRecord], ...] = tuple(group.record for group in GROUPS)


# ------------------------------------------------------------------ the declarations

_SAME = "same as StagingOptions"        # OptionDeclaration.cli_default: the field's own default


@dataclass(frozen=True)
class OptionDeclaration:
    """One field of StagingOptions, declared once for every front end: the ``pallet plan/push/pull`` command
    line (cli/staging.py), the Snakemake plugin's settings and the Parsl provider's keyword arguments.

    ``name``      the field (and the Snakemake setting and Parsl keyword: ``no_NAME`` in Snakemake for a
                  bool whose default is True).
    ``group``     the :class:`OptionGroup` (its ``attribute``) it belongs to: its ``--help`` section.
    ``type``      the type of one value: str, int or bool (a ``multiple`` option holds a tuple of them).
    ``help``      one sentence for every front end; for a bool whose default is True it says what the
                  negative (``--no-NAME``) does. ``{lacks}``, ``{rerun}``, ``{listed}`` are filled with each
                  command's words (command-line only options).
    ``flags``     the command line's flags (the first names it); () for none.
    ``metavar``, ``choices``  as argparse takes them (choices also checked by Snakemake and Parsl).
    ``multiple``  a tuple of values: a repeatable flag, one string split like a shell line in Snakemake.
    ``shell_split``  on the command line too, each value is split like a shell line (``--ssh-option``).
    ``size``      values are sizes such as 16M or 1G.
    ``minimum``   the smallest value allowed (ints).
    ``commands``  the ``pallet`` commands that take it.
    ``cli_default``  the command line's default where it differs from the field's (``ranks``: 0, one per CPU).
    ``negative_flags``, ``negative_help``  flags that set a bool to False, beside ``flags`` that set it True
                  (``--progress`` / ``--quiet``).
    ``snakemake``, ``parsl``  whether the Snakemake plugin has it as a setting, and PalletStaging as a keyword.
    """

    name: str
    group: str
    type: type
    help: str
    flags: tuple[str, ...] = ()
    metavar: str | None = None
    choices: tuple[Any, ...] = ()
    multiple: bool = False
    shell_split: bool = False
    size: bool = False
    minimum: int | None = None
    commands: tuple[str, ...] = ("push", "pull")
    cli_default: Any = _SAME
    negative_flags: tuple[str, ...] = ()
    negative_help: str = ""
    snakemake: bool = False
    parsl: bool = False

    @property
    def default(self) -> Any:
        """The field's default in StagingOptions."""
        own = _FIELDS[self.name]
        if own.default is dataclasses.MISSING and callable(own.default_factory):
            return own.default_factory()
        return own.default

    @property
    def command_line_default(self) -> Any:
        """The default on the command line (``cli_default``, else the field's)."""
        return self.default if self.cli_default == _SAME else self.cli_default

    @property
    def setting(self) -> str:
        """The Snakemake setting's name: ``no_NAME`` for a bool whose default is True, else ``name``."""
        return f"no_{self.name}" if self.type is bool and self.default is True else self.name

    def problem(self, value: Any, label: str) -> str | None:
        """What is wrong with ``value`` for this option (``label`` names it: a flag, a keyword), or None."""
        values = value if self.multiple else (value,)
        for one in values:
            if one is None:
                continue
            if self.choices and one not in self.choices:
                return f"{label} must be one of {', '.join(map(str, self.choices))}, not {one!r}"
            if self.minimum is not None and isinstance(one, int) and one < self.minimum:
                return f"{label} must be at least {self.minimum}, not {one}" if self.minimum else \
                    f"{label} must not be negative"
        return None


_FIELDS = {f.name: f for f in dataclasses.fields(StagingOptions)}

_ROUTE_URL = "ssh://[user@]host[:port] of a node that mounts the {} file system under the same paths"

OPTION_DECLARATIONS: tuple[OptionDeclaration, ...] = (
    # planning
    OptionDeclaration("strategy", "planning", str, "how to move the files: auto (the planner decides), individual, "
                      "bundle or hybrid", ("--strategy",), choices=STRATEGIES,
                      snakemake=True, parsl=True),
    OptionDeclaration("codec", "planning", str, "bundle compression: zstd, gzip or none (default: the plan's "
                      "choice for a push, zstd for a pull)", ("--codec",), choices=CODECS,
                      snakemake=True, parsl=True),
    OptionDeclaration("level", "planning", int, "compression level of every shard, e.g. 1 (zstd -5..-1, 1..19; "
                      "gzip 1..9; default: a stream's is fitted to the link and adjusted as it runs, a stored "
                      "bundle's is the codec's default)", ("--level",), "N", commands=("plan", "push")),
    OptionDeclaration("shard_size", "planning", int, "target uncompressed shard size, e.g. 16M (default: "
                      "automatic, 4-64 MiB; above 64M the bundle is stored and forwarded, not streamed)",
                      ("--shard-size",), "SIZE", size=True, minimum=1, parsl=True),
    OptionDeclaration("large_file_bytes", "planning", int, "hybrid: files at least this big travel individually "
                      "(default 64M)", ("--large-file",), "SIZE", size=True, minimum=1, parsl=True),
    OptionDeclaration("profile", "planning", str, "link profile from `pallet calibrate --name NAME` (default: "
                      "generic)", ("--profile",), "NAME", commands=("plan", "push", "pull"),
                      snakemake=True, parsl=True),
    OptionDeclaration("jobs", "planning", int, "local worker processes for packing and unpacking (default 0: "
                      "one per CPU, none for small work)", ("--jobs", "-j"), "N", minimum=0,
                      snakemake=True, parsl=True),
    # routing
    OptionDeclaration("stream", "routing", str, "stream bundles into the far-side unpacker when the transport "
                      "can: auto, on (insist) or off (store and forward)", ("--stream",),
                      choices=STREAM_MODES, parsl=True),
    OptionDeclaration("unpack_via", "routing", str, _ROUTE_URL.format("destination's") + "; mpi_stager unpacks "
                      "bundles there (gives GridFTP and Globus destinations a route)", ("--unpack-via",),
                      "SSH_URL", commands=("plan", "push"), snakemake=True, parsl=True),
    OptionDeclaration("unpack_job", "routing", str, "submit the unpack as a batch job through --unpack-via (a "
                      "login node) and wait for it", ("--unpack-job",), choices=("slurm",), commands=("push",),
                      parsl=True),
    OptionDeclaration("job_options", "routing", str, "extra #SBATCH lines for the unpack.sbatch of --unpack-job and "
                      "--keep-packed (e.g. --job-option=--partition=io --job-option=--time=1:00:00)",
                      ("--job-option",), "OPT", multiple=True, commands=("push",), parsl=True),
    OptionDeclaration("keep_packed", "routing", bool, "leave the bundle, its index and a ready-to-submit "
                      "unpack.sbatch in DEST/.pallet/incoming (any destination); submit it later with sbatch",
                      ("--keep-packed",), commands=("plan", "push")),
    OptionDeclaration("pack_via", "routing", str, _ROUTE_URL.format("source's") + "; mpi_stager packs there into "
                      "a temporary directory beside the source (gives GridFTP and Globus sources a route)",
                      ("--pack-via",), "SSH_URL", commands=("pull",), snakemake=True, parsl=True),
    # far side
    OptionDeclaration("remote_python", "far_side", str, "Python with pallet on an ssh far side, used as given. By "
                      "default pallet is looked for: where `pallet remote install` put it, as python3, behind "
                      "`pallet` on the login PATH or in ~/.local/bin; without pallet there, bundles go into the "
                      "far side's own tar (the tar-tools route)", ("--remote-python",), "CMD",
                      commands=("plan", "push", "pull"), snakemake=True, parsl=True),
    OptionDeclaration("ranks", "far_side", int, "far-side unpack/pack processes without a launcher, 0 for one "
                      "per CPU there", ("--ranks",), "N", minimum=0, commands=("plan", "push", "pull"),
                      cli_default=0, snakemake=True, parsl=True),
    OptionDeclaration("launcher", "far_side", str, "start mpi_stager at the far side through this, e.g. "
                      "'mpirun -n 8' or 'srun -n 64'", ("--launcher",), "CMD", snakemake=True, parsl=True),
    OptionDeclaration("reprobe", "far_side", bool, "probe the ssh far side again (its findings are cached for an "
                      "hour)", ("--reprobe",), commands=("plan", "push", "pull"), parsl=True),
    # transports
    OptionDeclaration("ssh_options", "transports", str, "extra ssh arguments for every connection, split like a shell "
                      "line, e.g. '-o ProxyJump=gateway' (also $PALLET_SSH_OPTIONS)", ("--ssh-option",), "OPT",
                      multiple=True, shell_split=True, commands=("plan", "push", "pull"), snakemake=True,
                      parsl=True),
    OptionDeclaration("transport_options", "transports", dict, "per scheme, options for that scheme's transport: "
                      "each front end offers every option a transport declares as SCHEME-NAME instead"),
    # policy
    OptionDeclaration("verify", "policy", bool, "skip the hash check of unpacked files", ("--no-verify",),
                      snakemake=True, parsl=True),
    OptionDeclaration("checksum", "policy", bool, "when DEST already holds files, compare those whose size, mtime "
                      "and mode match by md5 too (both sides are read; md5sum runs at an ssh far side)",
                      ("--checksum", "-c")),
    OptionDeclaration("retries", "policy", int, "retries after network errors, each resuming",
                      ("--retries",), "N", minimum=0, snakemake=True, parsl=True),
    OptionDeclaration("progress", "policy", bool, "always show per-stage progress (default: only on a terminal)",
                      ("--progress",), negative_flags=("--quiet", "-q"), negative_help="no progress"),
    OptionDeclaration("delete", "policy", bool, "remove what DEST holds that {lacks}; without it such entries are "
                      "kept. A rerun always {rerun} (type, size, mtime, mode, link target)", ("--delete",)),
    OptionDeclaration("dry_run", "policy", bool, "list what would be {listed}; change nothing", ("--dry-run", "-n")),
    OptionDeclaration("allow_root_dest", "policy", bool, "let DEST be the root directory / or a home directory "
                      "itself (/root, /home, /home/NAME, /Users/NAME, and your own $HOME for a local DEST); "
                      "refused by default, since pallet would list and mark all of it, and --delete would empty it "
                      "of all else", ("--allow-root-dest",)),
)


def declaration(name: str) -> OptionDeclaration:
    """The declaration of the StagingOptions field ``name`` (KeyError for another name)."""
    found = _BY_NAME.get(name)
    if found is None:
        raise KeyError(name)
    return found


_BY_NAME = {declared.name: declared for declared in OPTION_DECLARATIONS}


def declarations(group: str | None = None, *, command: str | None = None, snakemake: bool = False,
                 parsl: bool = False) -> tuple[OptionDeclaration, ...]:
    """The declarations, in group order, of ``group`` (None: every group) that ``command`` takes on the command
    line (None: any), and that are Snakemake settings / Parsl keywords when ``snakemake`` / ``parsl``."""
    order = [g.attribute for g in GROUPS]
    chosen = [d for d in OPTION_DECLARATIONS
              if (group is None or d.group == group) and (command is None or (d.flags and command in d.commands))
              and (d.snakemake or not snakemake) and (d.parsl or not parsl)]
    return tuple(sorted(chosen, key=lambda d: order.index(d.group)))


# ------------------------------------------------------------------ the options transports declare

@dataclass(frozen=True)
class TransportSetting:
    """An option a transport declares (``option``, a transports.base.TransportOption) for its ``scheme``, as
    every front end offers it: ``SCHEME_NAME`` (``--SCHEME-NAME`` on the command line,
    ``--storage-pallet-SCHEME-NAME`` in Snakemake, ``SCHEME_NAME=`` for PalletStaging); its value goes to
    ``StagingOptions.transport_options[scheme][option.name]``."""

    scheme: str
    option: TransportOption

    @property
    def name(self) -> str:
        return f"{self.scheme}_{self.option.name}".replace("-", "_").replace(".", "_").replace("+", "_")

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    @property
    def help(self) -> str:
        """The option's help, naming its transport, with its default (a bool's is on or off; None and ()
        are left to the option's own words)."""
        default = self.option.default
        if default is None or default == ():
            return f"{self.scheme} transport: {self.option.help}"
        shown = ("on" if default else "off") if self.option.type is bool else str(default)
        return f"{self.scheme} transport: {self.option.help} (default: {shown})"

    def problem(self, value: Any, label: str) -> str | None:
        """What is wrong with ``value`` (``label`` names where it was given), or None."""
        values = value if self.option.multiple else (value,)
        for one in values:
            if self.option.choices and one not in self.option.choices:
                return f"{label} must be one of {', '.join(map(str, self.option.choices))}, not {one!r}"
        return None


def transport_settings() -> tuple[TransportSetting, ...]:
    """Every option the registered transports declare (``registry.all_declared_options``) that a front end can
    offer: not a live object (``settable``), nor one a StagingOptions field gives (``staging_field``: ssh's
    ``ssh_options`` is ``--ssh-option``); by scheme, in scheme order."""
    from staging_core.transports.registry import all_declared_options
    return tuple(TransportSetting(scheme, option) for scheme, declared in all_declared_options().items()
                 for option in declared if option.settable and option.staging_field is None)
