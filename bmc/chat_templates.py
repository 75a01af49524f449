"""Chat templates a user names (`--chat-template NAME|FILE`): for a model that ships none (Gemma 3 270M's GGUF), or to
replace the one it ships. Written from the formats' own descriptions (ChatML, Llama 3's header tokens, Gemma's
turns); rendered by the tokenizer as HF transformers renders a model's own (jinja2, sandboxed). No torch here."""
from __future__ import annotations

import os

from .errors import InvalidRequestError

CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")

LLAMA3 = ("{{ bos_token }}{% for m in messages %}{{ '<|start_header_id|>' + m['role'] + '<|end_header_id|>\\n\\n'"
          " + m['content'] | trim + '<|eot_id|>' }}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}")

# Gemma has no system role: the system message opens the first user turn; the assistant's turns are "model" turns
GEMMA = ("{{ bos_token }}{% set ns = namespace(system='') %}{% for m in messages %}"
         "{% if m['role'] == 'system' %}{% set ns.system = m['content'] | trim + '\\n\\n' %}"
         "{% else %}{{ '<start_of_turn>' + ('model' if m['role'] == 'assistant' else 'user') + '\\n' + ns.system"
         " + m['content'] | trim + '<end_of_turn>\\n' }}{% set ns.system = '' %}{% endif %}{% endfor %}"
         "{% if add_generation_prompt %}{{ '<start_of_turn>model\\n' }}{% endif %}")

BUILT_IN = {"chatml": CHATML, "llama3": LLAMA3, "gemma": GEMMA}


def chat_template(spec: str) -> str:
    """The template `spec` names: a built-in (chatml, llama3, gemma) or a file holding a Jinja template."""
    if spec in BUILT_IN:
        return BUILT_IN[spec]
    path = os.path.expanduser(spec)
    if os.path.isfile(path):
        try:
            with open(path, encoding="utf-8") as f:
                text = f.read()
        except (OSError, UnicodeDecodeError) as e:
            raise InvalidRequestError(f"--chat-template {spec}: cannot read it ({e})") from None
        if not text.strip():
            raise InvalidRequestError(f"--chat-template {spec}: the file is empty")
        return text
    raise InvalidRequestError(f"--chat-template {spec!r} is neither a file nor a built-in template "
                              f"({', '.join(BUILT_IN)})")
