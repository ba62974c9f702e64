#!/bin/sh
# Checks that the man pages describe what exists (registered from packaging/Packaging.cmake):
# - writescope.toml(5) documents every key of the shipped etc/writescope.toml, at the same default,
#   and no key the file lacks;
# - writescoped(8) and writescopectl(1) document every long option their --help lists (and every
#   subcommand of writescopectl with its options), and no option that --help lacks.
#   check-man-coverage.sh SOURCE_DIR WRITESCOPED WRITESCOPECTL
set -eu
src=$1
writescoped=$2
writescopectl=$3
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
fail=0

# "section.key = value" from the TOML file (tables and uncommented keys) ...
awk '/^\[[a-z_]+\]/ { gsub(/[][]/, ""); sec = $1; next }
     /^[a-z_]+ *=/ { key = $1; sub(/^[^=]*= */, ""); sub(/ *#.*$/, ""); print sec "." key " = " $0 }' \
    "$src/etc/writescope.toml" | sort >"$work/toml"
# ... and from the man page: "# [section]" headings, then "*key* = value" entry lines.
awk '/^# \[[a-z_]+\]/ { sec = $2; gsub(/[][]/, "", sec); next }
     /^# / { sec = "" }
     sec != "" && /^\*[a-z_]+\* = / {
         key = $1; gsub(/\*/, "", key); sub(/^[^=]*= /, ""); sub(/ \(reloadable\)$/, "")
         print sec "." key " = " $0 }' \
    "$src/man/writescope.toml.5.scd" | sort >"$work/man5"
[ -s "$work/toml" ] || { echo "no keys found in etc/writescope.toml" >&2; exit 1; }
if ! cmp -s "$work/toml" "$work/man5"; then
    echo "writescope.toml(5) and etc/writescope.toml disagree (< the file, > the man page):" >&2
    diff "$work/toml" "$work/man5" >&2 || true
    fail=1
fi

# Long options in a --help text, and in the entry lines (those opening with "*") of the OPTIONS
# and COMMANDS sections of a man page.
help_options() { "$@" --help 2>&1 | grep -oE -- '--[a-z][a-z0-9-]*' | sort -u; }
man_options() {
    awk '/^# / { on = ($0 == "# OPTIONS" || $0 == "# COMMANDS"); next } on && /^\*/' "$1" |
        grep -oE -- '\*--[a-z][a-z0-9-]*\*' | tr -d '*' | sort -u
}
compare() { # what, expected file, documented file
    missing=$(comm -23 "$2" "$3")
    stale=$(comm -13 "$2" "$3")
    if [ -n "$missing" ]; then
        echo "$1 does not document: $(echo "$missing" | tr '\n' ' ')" >&2
        fail=1
    fi
    if [ -n "$stale" ]; then
        echo "$1 documents what --help lacks: $(echo "$stale" | tr '\n' ' ')" >&2
        fail=1
    fi
}

help_options "$writescoped" >"$work/d.help"
[ -s "$work/d.help" ] || { echo "writescoped --help lists no options" >&2; exit 1; }
man_options "$src/man/writescoped.8.scd" >"$work/d.man"
compare "writescoped(8)" "$work/d.help" "$work/d.man"

# writescopectl: the options of the program and of each subcommand (two levels: "policy set"),
# and the subcommands, each of which needs an entry line in COMMANDS ("*policy set* ..." or
# "*policy* [*show*]"). A help's subcommands are the first words of its "Subcommands:" list.
subcommands() {
    "$@" --help 2>&1 | awk 'tolower($0) ~ /^subcommands:/ { on = 1; next }
                            on && NF == 0 { on = 0 } on { print $1 }' | sort -u
}
documented() { # command words...
    entries=$(awk '/^# / { on = ($0 == "# COMMANDS"); next } on && /^\*/' \
        "$src/man/writescopectl.1.scd" | tr -d '*[]')
    printf '%s\n' "$entries" | grep -qE "^$*( |$)" ||
        { echo "writescopectl(1) does not document the command: $*" >&2; fail=1; }
}
subcommands "$writescopectl" >"$work/ctl.subs"
[ -s "$work/ctl.subs" ] || { echo "writescopectl --help lists no subcommands" >&2; exit 1; }
help_options "$writescopectl" >"$work/ctl.help"
while read -r sub; do
    documented "$sub"
    help_options "$writescopectl" "$sub" >>"$work/ctl.help"
    for nested in $(subcommands "$writescopectl" "$sub"); do
        documented "$sub" "$nested"
        help_options "$writescopectl" "$sub" "$nested" >>"$work/ctl.help"
    done
done <"$work/ctl.subs"
sort -u -o "$work/ctl.help" "$work/ctl.help"
man_options "$src/man/writescopectl.1.scd" >"$work/ctl.man"
compare "writescopectl(1)" "$work/ctl.help" "$work/ctl.man"

[ "$fail" -eq 0 ] && echo "man pages cover $(wc -l <"$work/toml") keys and every option and subcommand"
exit "$fail"
