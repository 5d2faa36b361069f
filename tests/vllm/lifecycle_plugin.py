"""pytest plugin (``-p lifecycle_plugin``): vLLM's own connector lifecycle tests against DcpJaxConnector.

vLLM's ``tests/v1/kv_connector/unit/utils.py`` builds every test's config with
``create_vllm_config(..., kv_connector="NixlConnector", kv_connector_module_path=None, ...)`` and
the lifecycle tests call it without connector arguments; replacing the defaults of those two
parameters in ``pytest_configure`` points every test at our class, unchanged otherwise.
``DCP_JAX_LIFECYCLE_CONNECTOR=nixl`` leaves vLLM's stock NixlConnector (the control run).
"""
import os


def pytest_configure(config):
    if os.environ.get("DCP_JAX_LIFECYCLE_CONNECTOR", "dcp_jax") != "dcp_jax":
        return
    import inspect

    from tests.v1.kv_connector.unit import utils

    fn = utils.create_vllm_config
    params = inspect.signature(fn).parameters
    names = [p.name for p in params.values() if p.default is not inspect.Parameter.empty]
    defaults = list(fn.__defaults__ or ())
    kw = dict(fn.__kwdefaults__ or {})
    new = {"kv_connector": "DcpJaxConnector", "kv_connector_module_path": "dcp_jax.adapters.vllm"}
    pos = names[len(names) - len(defaults):] if defaults else []
    for name, value in new.items():
        if name in kw:
            kw[name] = value
        elif name in pos:
            defaults[pos.index(name)] = value
        else:
            raise RuntimeError(f"create_vllm_config has no parameter {name!r}: vLLM's test utils changed")
    fn.__defaults__ = tuple(defaults) if defaults else None
    fn.__kwdefaults__ = kw or None
    config._dcp_jax_redirected = True


def pytest_report_header(config):
    which = os.environ.get("DCP_JAX_LIFECYCLE_CONNECTOR", "dcp_jax")
    return f"connector under test: {'DcpJaxConnector (dcp_jax.adapters.vllm)' if which == 'dcp_jax' else 'vLLM NixlConnector (control)'}"
