"""Chat templates in the forms of families surge cannot load here (no hub downloads): short
Jinja in the shape of Llama 3.1's and Mistral v0.3's tool-calling templates, with their call
formats, tool-result roles, and Mistral's refusal of tool call ids that are not 9 letters and
digits."""

LLAMA3 = """{{- bos_token -}}
<|start_header_id|>system<|end_header_id|>

Environment: ipython<|eot_id|>
{%- for message in messages %}
{%- if message.role == 'user' and loop.first and tools is not none -%}
<|start_header_id|>user<|end_header_id|>

Given the following functions, please respond with a JSON for a function call with its proper \
arguments that best answers the given prompt.

Respond in the format {"name": function name, "parameters": dictionary of argument name and \
its value}. Do not use variables.

{% for t in tools %}{{ t | tojson }}

{% endfor %}{{ message.content }}<|eot_id|>
{%- elif message.tool_calls is defined -%}
<|start_header_id|>assistant<|end_header_id|>

<|python_tag|>{% for c in message.tool_calls %}{{ {"name": c.function.name, \
"parameters": c.function.arguments} | tojson }}{% if not loop.last %}; {% endif %}\
{% endfor %}<|eom_id|>
{%- elif message.role == 'tool' -%}
<|start_header_id|>ipython<|end_header_id|>

{{ message.content }}<|eot_id|>
{%- else -%}
<|start_header_id|>{{ message.role }}<|end_header_id|>

{{ message.content }}<|eot_id|>
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt -%}
<|start_header_id|>assistant<|end_header_id|>

{% endif %}"""

MISTRAL = """{{- bos_token -}}
{%- for message in messages %}
{%- if message.role == 'user' -%}
{%- if tools is not none and loop.first -%}
[AVAILABLE_TOOLS] {{ tools | tojson }}[/AVAILABLE_TOOLS]
{%- endif -%}
[INST] {{ message.content }}[/INST]
{%- elif message.tool_calls is defined -%}
[TOOL_CALLS] [{% for c in message.tool_calls %}{{ {"name": c.function.name, \
"arguments": c.function.arguments, "id": c.id} | tojson }}{% if not loop.last %}, {% endif %}\
{% endfor %}]{{ eos_token }}
{%- elif message.role == 'tool' -%}
{%- if message.tool_call_id is not defined or message.tool_call_id | length != 9 -%}
{{ raise_exception("Tool call IDs should be alphanumeric strings with length 9!") }}
{%- endif -%}
[TOOL_RESULTS] {"content": {{ message.content | tojson }}, \
"call_id": "{{ message.tool_call_id }}"}[/TOOL_RESULTS]
{%- elif message.role == 'assistant' -%}
 {{ message.content }}{{ eos_token }}
{%- else -%}
{{ raise_exception("Only user, assistant and tool roles are supported") }}
{%- endif -%}
{%- endfor %}"""
