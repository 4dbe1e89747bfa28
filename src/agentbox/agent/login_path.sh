# Sourced as BASH_ENV by `bash -l -c CMD` (commands), after the login scripts. Debian's
# /etc/profile sets PATH outright, which silently replaced the PATH a template, a sandbox or a
# command gave: that PATH comes first again; directories the login scripts added stay, after it.
if [ -n "${AGENTBOX_PATH-}" ]; then
  __abx_path=$AGENTBOX_PATH
  __abx_rest=$PATH:
  while [ -n "$__abx_rest" ]; do
    __abx_dir=${__abx_rest%%:*}
    __abx_rest=${__abx_rest#*:}
    case ":$__abx_path:" in
      *":$__abx_dir:"*) ;;
      *) __abx_path=$__abx_path:$__abx_dir ;;
    esac
  done
  PATH=$__abx_path
  unset __abx_path __abx_rest __abx_dir
fi
unset AGENTBOX_PATH
# Not inherited by the command's own scripts; a BASH_ENV the caller set is theirs again.
if [ -n "${AGENTBOX_BASH_ENV+x}" ]; then
  BASH_ENV=$AGENTBOX_BASH_ENV
  unset AGENTBOX_BASH_ENV
  if [ -n "$BASH_ENV" ]; then . "$BASH_ENV"; fi
else
  unset BASH_ENV
fi
