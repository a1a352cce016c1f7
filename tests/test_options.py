"""StagingOptions: one flat record in five typed groups, which are also the sections of push/pull --help."""
from __future__ import annotations

import dataclasses
import pickle
import subprocess

import pytest

from staging_core.options import GROUPS, OPTION_GROUPS, FarSideOptions, PlanningOptions, PolicyOptions, \
    RoutingOptions, StagingOptions, TransportOptions
from tests.programs import program, user_env

SECTIONS = {"planning": ["--strategy", "--codec", "--shard-size", "--large-file", "--profile", "--jobs"],
            "far side": ["--remote-python", "--ranks", "--launcher", "--reprobe"],
            "transports": ["--ssh-option", "--ssh-parallel", "--gsiftp-concurrency", "--globus-local-endpoint"],
            "policy": ["--no-verify", "--checksum", "--retries", "--progress", "--quiet", "--json", "--delete",
                       "--dry-run"],
            "routing": ["--stream"]}


def test_every_field_is_in_exactly_one_group():
    grouped = [f.name for group in OPTION_GROUPS for f in dataclasses.fields(group)]
    assert sorted(grouped) == sorted(f.name for f in dataclasses.fields(StagingOptions))


def test_each_group_record_has_the_fields_types_and_defaults_of_staging_options():
    flat = {f.name: f for f in dataclasses.fields(StagingOptions)}
    for group in OPTION_GROUPS:
        for own in dataclasses.fields(group):
            assert own.type == flat[own.name].type, (group.__name__, own.name)
            assert own.default == flat[own.name].default, (group.__name__, own.name)
            assert own.default_factory == flat[own.name].default_factory, (group.__name__, own.name)
    assert [group.attribute for group in GROUPS] == ["planning", "routing", "far_side", "transports", "policy"]


def test_groups_are_views_and_build_the_same_options_back():
    options = StagingOptions(strategy="bundle", codec="gzip", unpack_via="ssh://login", ranks=4, launcher="srun -n 4",
                             ssh_options=("-p", "22"), retries=5, delete=True, transport_options={"vault": {"a": 1}})
    assert options.planning.strategy == "bundle" and options.routing.unpack_via == "ssh://login"
    assert options.far_side.launcher == "srun -n 4" and options.policy.retries == 5
    assert options.transports.transport_options == {"vault": {"a": 1}}
    assert isinstance(options.planning, PlanningOptions) and isinstance(options.routing, RoutingOptions)
    assert isinstance(options.far_side, FarSideOptions) and isinstance(options.transports, TransportOptions)
    assert isinstance(options.policy, PolicyOptions)
    rebuilt = StagingOptions.from_groups(options.planning, options.routing, options.far_side, options.transports,
                                         options.policy)
    assert rebuilt == options
    assert StagingOptions.from_groups(options.routing) == StagingOptions(unpack_via="ssh://login")
    assert pickle.loads(pickle.dumps(options.policy)) == options.policy        # Parsl ships options to workers


@pytest.mark.parametrize("command", ["push", "pull"])
def test_help_shows_the_groups_as_sections(command):
    helped = subprocess.run([program("pallet"), command, "--help"], capture_output=True, text=True, env=user_env(),
                            stdin=subprocess.DEVNULL, timeout=60)
    assert helped.returncode == 0, helped.stderr
    sections = {}
    current = None
    for line in helped.stdout.splitlines():
        if line and not line.startswith(" ") and line.endswith(":"):
            current = line.split(":")[0]
        elif current and line.lstrip().startswith("--"):
            sections.setdefault(current, []).append(line.split()[0].rstrip(","))
    for section, flags in SECTIONS.items():
        assert set(flags) <= set(sections.get(section, [])), (section, sections.get(section))
