"""Provisioning hosts over SSH: `dctl host provision` turns a bare host into a fleet member.

Modules:
- `target`: the `USER@HOST[:PORT]` a user names, parsed and printed the OpenSSH way.
- `ssh`: one verified SSH connection (Fabric on paramiko): commands with secrets masked,
  atomic file uploads. Re-exports the errors and `fingerprint`.
- `known_hosts`: which host keys to trust (the OpenSSH known-hosts file, read and appended).
- `errors`: the error hierarchy (`ProvisionError` and its kinds), one place.
- `facts`: what the remote host is (OS, Python, disk, GPUs, systemd, sudo) and whether it qualifies.
- `layout`: where things go on the host and the files written there (agent config, systemd unit).
- `wheel`: the dctl wheel of the running version, built on the fly from a source checkout.
- `provisioner`: the steps of one provisioning run, with undo on failure.
- `inventory`: many hosts from a file, provisioned in parallel.

Imported only inside command functions, so that `dctl --help` never pays for Fabric.
"""
