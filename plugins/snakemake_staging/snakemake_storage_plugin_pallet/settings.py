"""The plugin's `--storage-pallet-*` settings and their translation into pallet's StagingOptions.

``StorageProviderSettings`` is derived, not written out: its fields are the plugin's own (:class:`PluginSettings`:
how requests are batched and bundles kept), then one for every StagingOptions field declared as a Snakemake
setting (``staging_core.declarations(snakemake=True)``), then one for every option a transport declares
(``staging_core.transport_settings()``: ``SCHEME_NAME``, e.g. ``--storage-pallet-ssh-parallel 4``). Snakemake
reads the fields (their ``type`` metadata, defaults and help), so the class is made with
``dataclasses.make_dataclass``.
"""
# No `from __future__ import annotations` here: Snakemake reads these field types at run time (bool flags).

import dataclasses
import shlex
from dataclasses import dataclass, field
from typing import Any

from snakemake_interface_common.exceptions import WorkflowError
from snakemake_interface_storage_plugins.settings import StorageProviderSettingsBase

from staging_core import OptionDeclaration, StagingOptions, TransportSetting, declarations, parse_size, \
    transport_settings

PREFIX = "--storage-pallet-"


def _setting(default, text: str, kind):
    """A settings field: Snakemake needs the help text, the default and an explicit ``type`` for each."""
    return field(default=default, metadata={"help": text, "type": kind})


def budget(text: str) -> int:
    """A byte budget: a size as ``parse_size`` reads it (``500M``), or 0 for none."""
    return 0 if str(text).strip() == "0" else parse_size(text)


@dataclass
class PluginSettings(StorageProviderSettingsBase):
    """The plugin's own settings: how it batches the requests of a round, and keeps bundles.

    None of the settings carries a secret: credentials come from the
    transports' own sources (ssh keys and agent, X509 proxy, Globus token
    file), never from settings, because Snakemake copies settings into job
    scripts.
    """

    no_ondemand_links: bool = _setting(False, "Copy file:// inputs that Snakemake marks on-demand eligible "
                                              "(read once, sequentially, by one job) instead of linking them "
                                              "in place.", bool)
    keep_packed: bool = _setting(False, "Fetch the remote directory a batch's objects share once, whole, as one "
                                        "bundle kept below --storage-pallet-packed-dir, and copy each object "
                                        "out of it (hash-checked) when it is retrieved: remote jobs on one node "
                                        "share one fetch. Needs pallet at the source.", bool)
    packed_dir: str | None = _setting(None, "Where kept bundles live (default: .pallet-packed below the "
                                               "local storage prefix; in remote jobs, node-local when "
                                               "--remote-job-local-storage-prefix is); a directory "
                                               "only you can write into. $VARS and ~ are expanded where the "
                                               "inputs are retrieved (e.g. '/local/$USER/packed').", str)
    batch_window: float = _setting(0.0, "Seconds a batch stays open for more requests of the same round "
                                        "(0: until the scheduler has handed over the whole round).", float)
    batch_max_files: int = _setting(0, "Start a new batch after this many objects (0: no limit).", int)
    batch_max_bytes: int | None = _setting(None, "Start a new batch after this many bytes, e.g. 64G "
                                                    "(default: no limit).", parse_size)
    prefetch_budget: int = _setting(1 << 30, "The first retrieval from a location also fetches, in the same "
                                             "operation, the other inputs the workflow's jobs named there that "
                                             "exist remotely and are not here yet, up to this many bytes, e.g. "
                                             "500M (default 1G; 0: fetch only what each round asks for).",
                                    budget)
    session_idle: float = _setting(60.0, "Seconds a host's far-side session stays open without a request (it "
                                         "answers the run's small retrievals, stores and queries in one round "
                                         "trip each; the next request after it closed opens a new one).", float)


def _sentence(text: str) -> str:
    return text if text.endswith(".") else text + "."


def _declared_field(declared: OptionDeclaration) -> tuple[str, Any, Any]:
    """The setting of a declared StagingOptions field: ``no_NAME`` (a flag) for a bool whose default is True,
    one string split like a shell line for a ``multiple`` option, else a value of the declared type."""
    text = declared.help
    if declared.type is bool:
        return declared.setting, bool, _setting(False, _sentence(text), bool)
    if declared.multiple:
        return declared.setting, str | None, _setting(None, _sentence(text + "; one string"), str)
    default = declared.default
    if "default" not in text and default is not None:
        text += f" (default: {default})"
    kind = declared.type | None if default is None else declared.type
    return declared.setting, kind, _setting(default, _sentence(text), parse_size if declared.size else declared.type)


def transport_setting_name(setting: TransportSetting) -> str:
    """The setting of a transport's option: ``SCHEME_NAME``, or ``no_SCHEME_NAME`` for a bool whose default is
    True (Snakemake makes a bool defaulting to True a global --no-NAME flag, so none does)."""
    option = setting.option
    return f"no_{setting.name}" if option.type is bool and option.default is True else setting.name


def _transport_field(setting: TransportSetting) -> tuple[str, Any, Any]:
    """The setting of a transport's option (unset: the transport's default): a flag for a bool, one string split
    like a shell line for a ``multiple`` option, else a value of its type."""
    option, name = setting.option, transport_setting_name(setting)
    if option.type is bool:
        says = "turns it off" if name.startswith("no_") else "turns it on"
        return name, bool, _setting(False, _sentence(f"{setting.help}; this flag {says}"), bool)
    if option.multiple:
        return name, str | None, _setting(None, _sentence(setting.help + " (one string, split like a shell "
                                                                           "command line)"), str)
    return name, option.type | None, _setting(None, _sentence(setting.help), option.type)


DECLARED = declarations(snakemake=True)
TRANSPORT_SETTINGS = transport_settings()

StorageProviderSettings = dataclasses.make_dataclass(
    "StorageProviderSettings",
    [*(_declared_field(declared) for declared in DECLARED), *(_transport_field(s) for s in TRANSPORT_SETTINGS)],
    bases=(PluginSettings,))
StorageProviderSettings.__module__ = __name__                      # found by pickle (remote jobs, tagged copies)
StorageProviderSettings.__doc__ = (
    "Every `--storage-pallet-NAME VALUE` flag (also `[TAG::]VALUE` for tagged providers): the plugin's own "
    "(PluginSettings), pallet's options declared as Snakemake settings, and every transport's declared options "
    "as SCHEME_NAME.")


def flag(name: str) -> str:
    """The command-line flag of setting ``name``."""
    return PREFIX + name.replace("_", "-")


def check(settings: PluginSettings) -> None:
    """Raise WorkflowError naming the flag of any setting with a value pallet cannot use."""
    problems = []
    for declared in DECLARED:
        value = getattr(settings, declared.setting)
        if declared.multiple:
            problems.append(_split_problem(value, flag(declared.setting)))
        elif declared.type is not bool:
            problems.append(declared.problem(value, flag(declared.setting)))
    for setting in TRANSPORT_SETTINGS:
        name = transport_setting_name(setting)
        value = getattr(settings, name)
        if setting.option.multiple:
            problems.append(_split_problem(value, flag(name)))
        elif value is not None and setting.option.type is not bool:
            problems.append(setting.problem(value, flag(name)))
    if settings.batch_max_files < 0:
        problems.append(f"{flag('batch_max_files')} must not be negative")
    if settings.batch_window < 0:
        problems.append(f"{flag('batch_window')} must not be negative")
    if settings.prefetch_budget is not None and settings.prefetch_budget < 0:
        problems.append(f"{flag('prefetch_budget')} must not be negative")
    if settings.session_idle is not None and settings.session_idle <= 0:
        problems.append(f"{flag('session_idle')} must be positive")
    found = [problem for problem in problems if problem]
    if found:
        raise WorkflowError("invalid pallet storage settings: " + "; ".join(found))


def _split_problem(value: str | None, label: str) -> str | None:
    try:
        shlex.split(value or "")
    except ValueError as exc:
        return f"{label} cannot be split: {exc}"
    return None


def staging_options(settings: PluginSettings) -> StagingOptions:
    """The StagingOptions every batch of this provider runs with (no progress bars inside Snakemake's log): each
    declared setting's value, and the transports' options that were set, in ``transport_options``."""
    values: dict[str, Any] = {}
    for declared in DECLARED:
        value = getattr(settings, declared.setting)
        if declared.type is bool and declared.setting != declared.name:
            value = not value                                       # no_verify
        elif declared.multiple:
            value = tuple(shlex.split(value or ""))
        values[declared.name] = value
    given: list[tuple[TransportSetting, Any]] = []
    for setting in TRANSPORT_SETTINGS:
        name = transport_setting_name(setting)
        value = getattr(settings, name)
        if setting.option.type is bool:
            if value:                                               # the flag: the other value than the default
                given.append((setting, not name.startswith("no_")))
        elif value is not None:
            given.append((setting, tuple(shlex.split(value)) if setting.option.multiple else value))
    return StagingOptions(**values, progress=False).with_transport_values(given)
