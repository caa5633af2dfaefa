"""The tools of multi-turn rollouts (``actor_rollout_ref.rollout.multi_turn.*``): the calls the model
writes, parsed; the run's tools, declared in two files; their calls run in worker processes.

What the agent loop calls::

    calls, errors = parse_tool_calls(text, format="hermes")   # list[ToolCall], list[str] (one per bad block)
    toolset = ToolSet.from_config(cfg, log_file=path)         # the workers start; ValueError on a bad tool file
    toolset.schemas                                           # OpenAI function schemas, the chat template's tools=
    results = toolset.run([ToolRequest(call, tools_kwargs)])  # list[ToolResult(text, failure, seconds)], in order
    toolset.close()
    check_tool_files(cfg)                                     # the tool files' problems, at config validation

The two files (either or both):

- ``tool_config_path``: verl's YAML, ``tools: [{class_name, config, tool_schema}]``. ``class_name``
  ``dsrl:calculator``, ``dsrl:python`` and ``dsrl:sandbox_fusion`` (verl's ``SandboxFusionTool``, its config
  keys checked) are the built-ins (``dsrl.rollout.tools.builtin``; their ``tool_schema`` may be left out). Any
  other ``class_name`` is a user tool class, ``module.Class`` (importable) or ``path/file.py:Class`` (relative to
  the YAML's folder), with a ``tool_schema`` (``{type: function, function: {name, description, parameters}}``).
  Its protocol, dsrl's own::

      class MyTool:
          def __init__(self, config: dict, tool_schema: dict): ...    # once per worker
          def execute(self, parameters: dict, **kwargs) -> str: ...   # once per call; may be async def

  ``parameters`` are the arguments the model wrote (checked against ``tool_schema`` first); ``kwargs``
  are the row's ``extra_info["tools_kwargs"][<tool name>]["create_kwargs"]`` (verl's field), if any.
  verl's ``BaseTool`` subclasses cannot be imported here (they subclass verl's classes, and verl is not
  installed): to port one, drop the base class, keep ``__init__(config, tool_schema)``, and merge
  ``create``/``execute``/``release`` into one ``execute(parameters, **create_kwargs)`` that returns the
  text (``async def`` may stay; a ``ToolResponse``-like object with ``.text`` or a ``(text, reward,
  metrics)`` tuple is accepted, reward and metrics dropped).
- ``function_tool_path``: a .py file; each public function it defines (not imported, not starting with
  ``_``) is a tool, called with the arguments as keywords. Its name is the function's, its description
  the docstring's first paragraph, its parameters come from the annotations (str, int, float, bool,
  list, dict, Optional; a parameter without a default is required), their descriptions from a
  Google-style ``Args:`` section. verl needs its ``@function_tool`` decorator; plain functions suffice here.

A tool returns a str (or what ``execute`` may return, above); it runs in a worker of the reward
scorer's pool (``dsrl.workers.pool``): killed with its process group past ``multi_turn.tool_timeout``,
memory bounded by ``multi_turn.tool_memory_limit_mb``, prints to the log file. The model sees the
output cut to ``max_tool_response_length`` characters on ``tool_response_truncate_side``, or an error
text; ``ToolResult.failure`` is one of ``TOOL_FAILURE_KINDS`` (the loop counts them as
``tool/fail_<kind>``). This package imports no torch.
"""

from dsrl.rollout.tools.parse import ToolCall, parse_tool_calls, truncate
from dsrl.rollout.tools.specs import ToolSpec, check_tool_files, function_schema, load_tool_specs
from dsrl.rollout.tools.toolset import TOOL_FAILURE_KINDS, ToolRequest, ToolResult, ToolSet

__all__ = [
    "TOOL_FAILURE_KINDS",
    "ToolCall",
    "ToolRequest",
    "ToolResult",
    "ToolSet",
    "ToolSpec",
    "check_tool_files",
    "function_schema",
    "load_tool_specs",
    "parse_tool_calls",
    "truncate",
]
