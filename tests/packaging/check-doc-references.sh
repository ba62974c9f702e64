#!/bin/bash
# Checks that the project cites only files it has: every "NAME.md" named in a tracked document,
# or in a comment of a source, CMake or script file, exists in the repository (relative to the
# repository root, to the citing file's folder, or to docs/), and nothing points outside the
# tree (../shared, /work/...). Registered from packaging/Packaging.cmake.
#   check-doc-references.sh SOURCE_DIR
set -euo pipefail
src=$1
cd "$src"

# Cited by committed code before the page was written; remove an entry once its page exists.
pending=()

fail=0
report() { echo "$1: $2" >&2; fail=1; }
exists() { # citing file, reference
    local dir
    dir=$(dirname "$1")
    [ -e "$2" ] || [ -e "$dir/$2" ] || [ -e "docs/$2" ]
}

files=$(git ls-files -- '*.md' '*.scd' '*.txt' '*.cpp' '*.hpp' '*.cu' '*.cuh' '*.cmake' \
    'CMakeLists.txt' '*.sh' '*.py' '*.mjs' '*.in' '*.toml' '*.service' '*.socket' |
    grep -v -e '^tests/text/' -e '^tests/packaging/check-doc-references.sh$' || true)
files+=$'\n'$(git ls-files -- 'tests/text/*.md' 'tests/text/*.mjs' 'tests/text/*.py' || true)
[ -n "$files" ] || { echo "no files found under $src (not a git checkout?)" >&2; exit 1; }

while IFS= read -r f; do
    [ -f "$f" ] || continue
    case $f in
    *.md | *.scd | *.txt) text=$(cat "$f") ;;
    # Code: only comments ("//" and "#" to the end of the line), so that a member such as
    # data.md is not read as a file name.
    *) text=$(sed -n 's@^.*//\(.*\)$@\1@p; s@^\s*#\(.*\)$@\1@p' "$f") ;;
    esac
    while IFS= read -r ref; do
        [ -n "$ref" ] || continue
        exists "$f" "$ref" && continue
        for p in "${pending[@]}"; do
            [ "$ref" != "$p" ] && [ "$ref" != "${p#docs/}" ] || continue 2
        done
        report "$f" "cites $ref, which is not in the repository"
    done < <(grep -oE '[A-Za-z0-9_./-]*[A-Za-z0-9_-]+\.md\b' <<<"$text" | sort -u || true)
    if grep -qE '\.\./shared|/work/' <<<"$text"; then
        report "$f" "points outside the repository: $(grep -oE '\S*(\.\./shared|/work/)\S*' <<<"$text" | head -n1)"
    fi
done <<<"$files"

[ "$fail" -eq 0 ] && echo "every cited document is in the repository"
exit "$fail"
