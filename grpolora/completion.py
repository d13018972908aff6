"""`grpolora completion bash|zsh`: a completion script made from the argument parser itself, so it never lists a
command or an option the CLI does not have. zsh runs the bash function through bashcompinit (as kubectl's and
the AWS CLI's zsh completions may)."""

from __future__ import annotations

import argparse
import shlex
import sys

SHELLS = ("bash", "zsh")
FUNCTION = "_grpolora_complete"


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:  # argparse keeps its subcommands here, and offers no public accessor
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def _words(values) -> str:
    return shlex.quote(" ".join(values))


def bash_script(parser: argparse.ArgumentParser) -> str:
    commands = _subparsers(parser)
    option_cases, choice_cases, positional_cases = [], [], []
    for name, sub in commands.items():
        options = [s for a in sub._actions for s in a.option_strings]
        option_cases.append(f"        {name}) opts={_words(options)} ;;")
        for action in sub._actions:
            if action.choices is None:
                continue
            if action.option_strings:
                for option in action.option_strings:
                    choice_cases.append(f"        '{name} {option}') words={_words(action.choices)} ;;")
            else:
                positional_cases.append(f"        {name}) words={_words(action.choices)} ;;")
    top = sorted(s for a in parser._actions for s in a.option_strings)
    return f"""# grpolora shell completion: source <(grpolora completion bash)
{FUNCTION}() {{
    local cur prev cmd opts="" words=""
    cur="${{COMP_WORDS[COMP_CWORD]}}"
    prev="${{COMP_WORDS[COMP_CWORD-1]}}"
    cmd="${{COMP_WORDS[1]}}"
    if [ "$COMP_CWORD" -le 1 ]; then
        if [[ "$cur" == -* ]]; then words={_words(top)}; else words={_words(commands)}; fi
        COMPREPLY=($(compgen -W "$words" -- "$cur"))
        return 0
    fi
    case "$cmd $prev" in
{chr(10).join(choice_cases)}
    esac
    if [ -n "$words" ]; then
        COMPREPLY=($(compgen -W "$words" -- "$cur"))
        return 0
    fi
    case "$cmd" in
{chr(10).join(option_cases)}
    esac
    if [[ "$cur" == -* ]]; then
        COMPREPLY=($(compgen -W "$opts" -- "$cur"))
        return 0
    fi
    case "$cmd" in
{chr(10).join(positional_cases)}
    esac
    if [ -n "$words" ]; then
        COMPREPLY=($(compgen -W "$words" -- "$cur"))
    else
        COMPREPLY=($(compgen -f -- "$cur"))
    fi
    return 0
}}
complete -o filenames -F {FUNCTION} grpolora
"""


def print_script(parser: argparse.ArgumentParser, shell: str) -> int:
    script = bash_script(parser)
    if shell == "zsh":
        zsh = "# grpolora shell completion: source <(grpolora completion zsh)\n"
        script = zsh + "autoload -U +X bashcompinit && bashcompinit\n" + script
    sys.stdout.write(script)
    return 0
