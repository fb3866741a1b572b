#!/usr/bin/env bash
# A throwaway PostgreSQL server for the store tests (Debian's postgresql package).
#   pg_test_server.sh start DATADIR PORT   install if needed, initdb, start on 127.0.0.1:PORT
#                                          (trust auth), create role and database `grpod`, and
#                                          role and database `grpod_pw` that must give its
#                                          password (scram-sha-256; the secrets tests)
#   pg_test_server.sh stop DATADIR PORT    stop it and remove the data directory
# Idempotent: an initialised DATADIR is reused, a running server is left running.
# As root the server runs as the `postgres` user (PostgreSQL refuses to run as root), so
# DATADIR must be somewhere `postgres` can reach (the Makefile uses /tmp/grpod-pgtest-PORT,
# not the clone, which may sit under a 0700 directory).
set -euo pipefail

die() {
    echo "pg_test_server: error: $*" >&2
    exit 1
}

[[ $# -eq 3 ]] || die "usage: $0 start|stop DATADIR PORT"
action="$1"
PG_TEST_PASSWORD="grpod-test-secret-5f1c"  # tests/daemon/test_secrets.py greps for it
port="$3"
[[ "$port" =~ ^[0-9]+$ ]] || die "PORT must be a number, got '$port'"
# a fixed port inside the kernel's ephemeral range can be taken by any outgoing connection
# (a vLLM worker beside the tests opens a dozen): the server would fail to start
if [[ "$1" == "start" && -r /proc/sys/net/ipv4/ip_local_port_range ]]; then
    read -r low high </proc/sys/net/ipv4/ip_local_port_range
    if ((port >= low && port <= high)); then
        die "PORT $port is inside the kernel's ephemeral range $low-$high (ip_local_port_range): pick one below $low"
    fi
fi
mkdir -p "$(dirname "$2")"
datadir="$(cd "$(dirname "$2")" && pwd)/$(basename "$2")"

find_bindir() {
    local initdb
    if initdb="$(command -v initdb 2>/dev/null)"; then
        dirname "$(readlink -f "$initdb")"
        return 0
    fi
    local dir
    dir="$(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V | tail -n 1)"
    [[ -n "$dir" && -x "$dir/initdb" ]] || return 1
    echo "$dir"
}

as_owner() {  # run a command as the server's owner
    if [[ "$(id -u)" == "0" ]]; then
        (cd / && runuser -u postgres -- "$@")  # its cwd may be a 0700 clone
    else
        "$@"
    fi
}

running() {
    [[ -f "$datadir/PG_VERSION" ]] && as_owner "$bindir/pg_ctl" -D "$datadir" status >/dev/null 2>&1
}

install_postgres() {
    command -v apt-get >/dev/null || die "initdb not found and no apt-get to install postgresql"
    [[ "$(id -u)" == "0" ]] || die "initdb not found; installing postgresql needs root"
    echo "pg_test_server: installing Debian's postgresql package" >&2
    apt-get update -qq >/dev/null || die "apt-get update failed"
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq postgresql >/dev/null ||
        die "apt-get install postgresql failed"
}

psql_admin() {
    "$bindir/psql" -X -q -v ON_ERROR_STOP=1 -h 127.0.0.1 -p "$port" -U postgres -d postgres "$@"
}

if ! bindir="$(find_bindir)"; then
    [[ "$action" == "stop" ]] && exit 0  # nothing installed, nothing running
    install_postgres
    bindir="$(find_bindir)" || die "postgresql installed but initdb still not found"
fi

case "$action" in
start)
    if [[ "$(id -u)" == "0" ]] && ! runuser -u postgres -- test -x "$(dirname "$datadir")"; then
        die "the postgres user cannot reach $(dirname "$datadir") (a 0700 parent?); give a DATADIR under /tmp"
    fi
    if [[ ! -f "$datadir/PG_VERSION" ]]; then
        mkdir -p "$datadir"
        [[ "$(id -u)" == "0" ]] && chown postgres: "$datadir"
        chmod 0700 "$datadir"
        as_owner "$bindir/initdb" -D "$datadir" -U postgres -A trust --no-locale -E UTF8 \
            >"$datadir.initdb.log" 2>&1 || die "initdb failed, see $datadir.initdb.log"
    fi
    if ! running; then
        as_owner "$bindir/pg_ctl" -D "$datadir" -l "$datadir/server.log" -w -t 60 \
            -o "-p $port -c listen_addresses=127.0.0.1 -k $datadir -c fsync=off" start \
            >/dev/null || die "server did not start, see $datadir/server.log"
    fi
    if [[ "$(psql_admin -tAc "SELECT 1 FROM pg_roles WHERE rolname = 'grpod'")" != "1" ]]; then
        psql_admin -c "CREATE ROLE grpod LOGIN CREATEDB"
    fi
    if [[ "$(psql_admin -tAc "SELECT 1 FROM pg_database WHERE datname = 'grpod'")" != "1" ]]; then
        psql_admin -c "CREATE DATABASE grpod OWNER grpod"
    fi
    # a role that connects with a password only (tests/daemon/test_secrets.py): the rule is
    # pg_hba.conf's first, before the trust lines
    if ! grep -q "grpod_pw" "$datadir/pg_hba.conf"; then
        as_owner sh -c "printf 'host all grpod_pw 127.0.0.1/32 scram-sha-256\n' | \
            cat - '$datadir/pg_hba.conf' >'$datadir/pg_hba.new' && \
            mv '$datadir/pg_hba.new' '$datadir/pg_hba.conf'"
        as_owner "$bindir/pg_ctl" -D "$datadir" reload >/dev/null
    fi
    if [[ "$(psql_admin -tAc "SELECT 1 FROM pg_roles WHERE rolname = 'grpod_pw'")" != "1" ]]; then
        psql_admin -c "CREATE ROLE grpod_pw LOGIN PASSWORD '$PG_TEST_PASSWORD'"
    fi
    if [[ "$(psql_admin -tAc "SELECT 1 FROM pg_database WHERE datname = 'grpod_pw'")" != "1" ]]; then
        psql_admin -c "CREATE DATABASE grpod_pw OWNER grpod_pw"
    fi
    echo "pg_test_server: postgresql+psycopg://grpod@127.0.0.1:$port/grpod ($datadir)"
    ;;
stop)
    if running; then
        as_owner "$bindir/pg_ctl" -D "$datadir" -m fast -w stop >/dev/null
    fi
    if [[ -f "$datadir/PG_VERSION" ]]; then  # only a data directory this script made
        rm -rf "$datadir" "$datadir.initdb.log"
    fi
    ;;
*)
    die "unknown action '$action' (start or stop)"
    ;;
esac
