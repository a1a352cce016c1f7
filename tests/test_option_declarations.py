"""The front ends agree with the option declarations: every declared option that applies to the command line, the
Snakemake settings or the Parsl provider is there, with the declared default, and so is every option the
transports declare; a live connection never travels in ``transport_options``."""
from __future__ import annotations

import dataclasses
import inspect
import sys

import pytest

from staging_core.cli.main import build_parser
from staging_core.cli.staging import connecting_early, staging_options
from staging_core.options import GROUPS, OPTION_DECLARATIONS, StagingOptions, declaration, declarations, \
    transport_settings
from staging_core.transports.registry import all_declared_options

COMMANDS = ("plan", "push", "pull")


def _parse(command: str, *flags: str):
    ends = ["src", "/dest"]
    return build_parser(command).parse_args([command, *flags, *ends])


def _sections(command: str) -> dict[str, list[str]]:
    """``command --help``: the flags of each section, by the section's title."""
    parser = build_parser(command)
    sub = next(action for action in parser._actions if hasattr(action, "choices") and action.choices)
    helped = sub.choices[command].format_help()
    sections: dict[str, list[str]] = {}
    current = None
    for line in helped.splitlines():
        if line and not line.startswith(" ") and line.endswith(":"):
            current = line.split(":")[0]
        elif current and line.lstrip().startswith("-"):
            sections.setdefault(current, []).extend(word.rstrip(",") for word in line.split()
                                                    if word.startswith("-"))
    return sections


# ---------------------------------------------------------------- the declarations themselves

def test_every_field_of_staging_options_is_declared_once_in_its_group():
    names = [declared.name for declared in OPTION_DECLARATIONS]
    assert sorted(names) == sorted(f.name for f in dataclasses.fields(StagingOptions))
    groups = {group.attribute: group.record for group in GROUPS}
    for declared in OPTION_DECLARATIONS:
        assert declared.name in {f.name for f in dataclasses.fields(groups[declared.group])}, declared.name
        assert declaration(declared.name) is declared
        if declared.choices:
            assert declared.default is None or declared.default in declared.choices, declared.name
        for value in (declared.default, declared.command_line_default):
            assert declared.problem(value, declared.name) is None, declared.name


def test_the_transport_settings_are_what_the_transports_declare():
    offered = {(s.scheme, s.option.name) for s in transport_settings()}
    declared = {(scheme, option.name) for scheme, options in all_declared_options().items() for option in options
                if option.settable and option.staging_field is None}
    assert offered == declared and ("ssh", "parallel") in offered
    given_by_fields = {option.staging_field for options in all_declared_options().values() for option in options
                       if option.staging_field}
    assert given_by_fields <= {d.name for d in OPTION_DECLARATIONS}           # ssh_options: --ssh-option
    names = [s.name for s in transport_settings()]
    assert len(set(names)) == len(names) and not set(names) & {d.name for d in OPTION_DECLARATIONS}


# ---------------------------------------------------------------- the command line

@pytest.mark.parametrize("command", COMMANDS)
def test_the_command_line_defaults_are_the_declared_ones(command):
    options = staging_options(_parse(command), command)
    taken = {d.name for d in declarations(command=command)}
    for declared in OPTION_DECLARATIONS:
        expected = declared.command_line_default if declared.name in taken else declared.default
        assert getattr(options, declared.name) == expected, declared.name
    assert options.transport_options == {}


@pytest.mark.parametrize("command", COMMANDS)
def test_help_lists_each_declared_option_in_its_group_section(command):
    sections = _sections(command)
    for group in GROUPS:
        wanted = [flag for d in declarations(group.attribute, command=command) for flag in (*d.flags,
                                                                                              *d.negative_flags)]
        if command != "plan" and group.attribute == "transports":
            wanted += [s.flag for s in transport_settings()]
        assert set(wanted) <= set(sections.get(group.title, [])), (group.title, set(wanted) - set(
            sections.get(group.title, [])))
    listed = {flag for flags in sections.values() for flag in flags}
    others = {d.name for d in OPTION_DECLARATIONS} - {d.name for d in declarations(command=command)}
    assert not {flag for name in others for flag in declaration(name).flags} & listed


def test_flags_set_the_declared_fields_and_the_transports_options():
    args = _parse("push", "--strategy", "bundle", "--ranks", "3", "--ssh-option", "-o ConnectTimeout=5",
                  "--job-option=--partition=io", "--no-verify", "--quiet", "--shard-size", "16M",
                  "--ssh-parallel", "4", "--no-gsiftp-fast", "--gsiftp-options=-s", "--gsiftp-options", "subj",
                  "--globus-timeout", "30", "--file-link-mode", "hardlink")
    options = staging_options(args)
    assert (options.strategy, options.ranks, options.verify, options.progress) == ("bundle", 3, False, False)
    assert options.ssh_options == ("-o", "ConnectTimeout=5") and options.job_options == ("--partition=io",)
    assert options.shard_size == 16 << 20
    assert options.transport_options == {"ssh": {"parallel": 4}, "gsiftp": {"fast": False, "options": ("-s", "subj")},
                                         "globus": {"timeout": 30.0}, "file": {"link_mode": "hardlink"}}
    with pytest.raises(SystemExit):
        _parse("push", "--file-link-mode", "symlink")


# ---------------------------------------------------------------- the Snakemake settings

def test_snakemake_settings_are_the_declared_ones_with_their_defaults():
    pytest.importorskip("snakemake")
    from snakemake_storage_plugin_pallet import StorageProviderSettings, settings as module
    from snakemake_storage_plugin_pallet.settings import staging_options as from_settings, transport_setting_name
    fields = {f.name: f for f in dataclasses.fields(StorageProviderSettings)}
    for declared in declarations(snakemake=True):
        own = fields[declared.setting]
        assert "type" in own.metadata and own.metadata["help"], declared.name
        if declared.type is bool:
            assert own.type is bool and own.default is False, declared.name     # no_NAME when the default is True
        elif declared.multiple:
            assert own.default is None and declared.default == (), declared.name
        else:
            assert own.default == declared.default, declared.name
    for setting in transport_settings():
        own = fields[transport_setting_name(setting)]
        assert "type" in own.metadata and setting.scheme in own.metadata["help"]
        assert own.default is (False if setting.option.type is bool else None)    # unset: the transport's default
    assert not [f.name for f in fields.values() if f.type is bool and f.default is True]   # no global --no-NAME
    assert not hasattr(module, "annotations")            # no `from __future__ import annotations`: types at run time
    assert from_settings(StorageProviderSettings()) == StagingOptions(progress=False)
    off = from_settings(StorageProviderSettings(no_verify=True, ssh_options="-p 22", no_gsiftp_fast=True,
                                                ssh_parallel=2, globus_data_access="a b"))
    assert (off.verify, off.ssh_options) == (False, ("-p", "22"))
    assert off.transport_options == {"gsiftp": {"fast": False}, "ssh": {"parallel": 2},
                                     "globus": {"data_access": ("a", "b")}}


def test_snakemake_names_the_flag_of_a_bad_setting():
    pytest.importorskip("snakemake")
    from snakemake_interface_common.exceptions import WorkflowError

    from snakemake_storage_plugin_pallet import StorageProviderSettings
    from snakemake_storage_plugin_pallet.settings import check
    with pytest.raises(WorkflowError) as raised:
        check(StorageProviderSettings(strategy="fast", ranks=-1, globus_sync_level="never", ssh_options="'"))
    for flag in ("--storage-pallet-strategy", "--storage-pallet-ranks", "--storage-pallet-globus-sync-level",
                 "--storage-pallet-ssh-options"):
        assert flag in str(raised.value)


# ---------------------------------------------------------------- the Parsl provider

def test_parsl_keywords_are_the_declared_ones_with_their_defaults():
    pytest.importorskip("parsl")
    from pallet_parsl import PalletStaging
    from pallet_parsl.provider import STAGING_KEYWORDS, TRANSPORT_KEYWORDS
    assert set(STAGING_KEYWORDS) == {d.name for d in declarations(parsl=True)}
    assert set(TRANSPORT_KEYWORDS) == {s.name for s in transport_settings()}
    own = set(inspect.signature(PalletStaging).parameters) - {"pallet_options"}
    assert not own & (set(STAGING_KEYWORDS) | set(TRANSPORT_KEYWORDS))      # keep_packed stays the provider's
    assert PalletStaging().options == StagingOptions()
    for name, declared in STAGING_KEYWORDS.items():
        assert PalletStaging(**{name: declared.default}).options == StagingOptions(), name
    staged = PalletStaging(strategy="bundle", ssh_options="-p 2222", ssh_parallel=3, gsiftp_options=["-s", "x"],
                           options=StagingOptions(retries=5))
    assert staged.options == StagingOptions(strategy="bundle", ssh_options=("-p", "2222"), retries=5,
                                            transport_options={"ssh": {"parallel": 3},
                                                               "gsiftp": {"options": ("-s", "x")}})
    with pytest.raises(TypeError, match="nothing"):
        PalletStaging(nothing=1)
    with pytest.raises(Exception, match="globus_sync_level must be one of"):
        PalletStaging(globus_sync_level="never")


# ---------------------------------------------------------------- a live connection has its own channel

def test_the_early_connection_is_handed_over_outside_the_options(sshd, tmp_path):
    from staging_core.operations.push_pull import push
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.txt").write_text("a\n")
    url = sshd.url(str(tmp_path / "dest"))
    options = StagingOptions(ssh_options=tuple(sshd.ssh_options), remote_python=sys.executable, progress=False)
    with connecting_early(url, options) as early:
        assert early is not None and early.option == "master"
        assert options.transport_options == {}
        result = push(str(src), url, options, early_connection=early)
        assert early.connection._adopted                    # the push's transport took the connection over
    assert result.files == 1 and (tmp_path / "dest" / "a.txt").read_text() == "a\n"
    with connecting_early(str(tmp_path / "local"), options) as none:
        assert none is None                                  # a local destination has no connection to start
