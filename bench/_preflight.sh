# Sourced by the bench scripts before their first run: the longmoe that python3 imports outside
# this folder must be this checkout, installed (its backends and tuning packages map from the
# repository's top level), or every arm would fail the same way after minutes of setup.
_lm_root=$(pwd)
[ -f "$_lm_root/pyproject.toml" ] || { echo "bench: run from the repository root (no pyproject.toml in $_lm_root)" >&2; exit 2; }
_lm_at=$(cd / && python3 -c "import longmoe.backends, longmoe.tuning, longmoe, os; print(os.path.dirname(os.path.dirname(longmoe.__file__)))" 2>/dev/null)
if [ "$_lm_at" != "$_lm_root" ]; then
    echo "bench: python3 does not import this checkout's longmoe (${_lm_at:-not installed}); run: python3 -m pip install --no-deps --no-build-isolation -e ." >&2
    exit 2
fi
