#!/usr/bin/env bash
# pallet set-up and entry point: installs what pallet needs, then runs the demo or the tests.
#
#   ./bootstrap.sh demo [ARGS...]   install (if needed), then run `pallet demo`
#   ./bootstrap.sh test [ARGS...]   install (if needed), then run the whole test suite, one test file per
#                                   worker in $PALLET_TEST_WORKERS (default 3) parallel workers; ARGS go to
#                                   pytest (`-n 0` runs in this process)
#   ./bootstrap.sh install          install only
#
# Idempotent: apt packages are installed only when missing, the virtualenv
# (.venv, or $PALLET_VENV) is reused, and the package is reinstalled in place.
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
venv=${PALLET_VENV:-$here/.venv}
apt_packages=(pigz zstd rsync openssh-server openssh-client openmpi-bin libopenmpi-dev
              globus-gridftp-server-progs globus-gass-copy-progs iproute2 python3-venv slurm-wlm munge
              iptables iputils-ping libnetfilter-queue-dev gcc fuse3)

log() { printf 'bootstrap: %s\n' "$*" >&2; }

install_apt() {
    local missing=() pkg
    for pkg in "${apt_packages[@]}"; do
        dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q 'install ok installed' || missing+=("$pkg")
    done
    [ ${#missing[@]} -eq 0 ] && return 0
    if [ "$(id -u)" -ne 0 ]; then
        log "missing system packages: ${missing[*]}; run this as root or install them with apt-get"
        exit 1
    fi
    log "installing system packages: ${missing[*]}"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
}

# pallet's build requirements, installed into the venv too: `pallet remote install` then builds pallet's wheel
# here without the package index
build_tools=(pip setuptools wheel setuptools-rust)

# What an install depends on: the package metadata, the build tools and the list of modules (a strict editable
# install links each module, so a new one needs a reinstall; edits to existing ones are seen at once).
install_fingerprint() {
    (cd "$here" && echo "${build_tools[*]}" && cat setup.cfg pyproject.toml \
                    && find bundles staging_core mpi_stager plugins -name '*.py' | sort \
                    && cat bundles/native/Cargo.toml bundles/native/src/*.rs) \
        | sha256sum | cut -d' ' -f1
}

# setuptools-rust builds the native engine next to the sources in an editable install, but the strict link tree
# lists only what setuptools itself built: link the module in, where the installed `bundles` package is.
link_native_engine() {
    local built package
    built=$(find "$here/bundles" -maxdepth 1 -name '_native*.so' -print -quit)
    if [ -z "$built" ]; then
        log "the native engine was not built (cargo missing or the build failed): pallet runs its Python engine"
        return 0
    fi
    package=$(cd / && "$venv/bin/python" -I -c 'import bundles, os; print(os.path.dirname(bundles.__file__))')
    [ "$package" = "$here/bundles" ] || ln -sfn "$built" "$package/$(basename "$built")"
}

# cargo as rustup installs it, or Debian's; the native engine is optional, so its absence is not fatal.
find_cargo() {
    [ -d "$HOME/.cargo/bin" ] && export PATH="$HOME/.cargo/bin:$PATH"
    command -v cargo >/dev/null && return 0
    if [ "$(id -u)" -eq 0 ]; then
        log "installing cargo (Debian's) to build the native engine"
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends cargo >/dev/null || true
    fi
}

install_python() {
    local stamp="$venv/.pallet-installed" fingerprint
    if [ ! -x "$venv/bin/python" ]; then
        log "creating virtualenv $venv"
        python3 -m venv "$venv"
    fi
    find_cargo
    fingerprint=$(install_fingerprint)
    if [ "$(cat "$stamp" 2>/dev/null)" != "$fingerprint" ]; then
        log "installing pallet and its extras into $venv"
        "$venv/bin/python" -m pip install -q --upgrade "${build_tools[@]}"
        # strict mode puts a tree of links on sys.path: Snakemake's plugin scan (pkgutil) cannot see the
        # import hook of the default editable mode, so the plugin would not be found
        "$venv/bin/python" -m pip install -q --config-settings editable_mode=strict -e "$here[all,test,bench]"
        link_native_engine
        echo "$fingerprint" > "$stamp"
    fi
}

main() {
    local cmd=${1:-}
    [ $# -gt 0 ] && shift
    case "$cmd" in
        install) install_apt; install_python ;;
        demo) install_apt; install_python; exec "$venv/bin/pallet" demo "$@" ;;
        test)
            install_apt; install_python
            cd "$here"
            exec "$venv/bin/python" -m pytest -n "${PALLET_TEST_WORKERS:-3}" --dist loadfile "$@" ;;
        *) sed -n '2,11p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; exit 2 ;;
    esac
}

main "$@"
