import pytest

from opefo_trl._compat import TRL_MAX_EXCLUSIVE, TRL_MIN, check_trl_version


@pytest.mark.parametrize("version", ["1.16.0", "1.16.3", "1.16.1.dev0"])
def test_supported_trl_versions_pass(version):
    assert check_trl_version(version) == version


@pytest.mark.parametrize("version", ["1.15.0", "0.29.1", "1.17.0", "2.0.0"])
def test_unsupported_trl_versions_fail_with_the_range_and_the_fix(version):
    with pytest.raises(
        ImportError, match=rf"supports TRL >={TRL_MIN},<{TRL_MAX_EXCLUSIVE}, but TRL {version}.*pip install"
    ):
        check_trl_version(version)


def test_installed_trl_is_supported():
    import trl

    assert check_trl_version() == trl.__version__
