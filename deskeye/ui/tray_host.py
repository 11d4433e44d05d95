"""Is there a system tray to dock into? XEmbed hosts (trayer, tint2, stalonetray, xfce/mate panels) own the
X selection `_NET_SYSTEM_TRAY_S<screen>`; StatusNotifierItem hosts (KDE, GNOME with the AppIndicator
extension) register with `org.kde.StatusNotifierWatcher` on the session D-Bus."""

from __future__ import annotations

import enum
import logging
import os

log = logging.getLogger(__name__)

SNI_WATCHER = "org.kde.StatusNotifierWatcher"
DBUS_TIMEOUT_S = 2.0


class TrayHost(enum.StrEnum):
    XEMBED = "xembed"
    SNI = "sni"
    NONE = "none"


def find_tray_host() -> TrayHost:
    if has_sni_watcher():
        return TrayHost.SNI
    if has_xembed_tray():
        return TrayHost.XEMBED
    return TrayHost.NONE


def has_xembed_tray() -> bool:
    if not os.environ.get("DISPLAY"):
        return False
    try:
        from Xlib import display
        conn = display.Display()
    except Exception as exc:
        log.debug("cannot open the display to look for a tray: %s", exc)
        return False
    try:
        atom = conn.intern_atom(f"_NET_SYSTEM_TRAY_S{conn.get_default_screen()}")
        owner = conn.get_selection_owner(atom)
        return bool(owner) and not isinstance(owner, int) and owner.id != 0
    except Exception as exc:
        log.debug("cannot read the tray selection: %s", exc)
        return False
    finally:
        conn.close()


def has_sni_watcher() -> bool:
    if not os.environ.get("DBUS_SESSION_BUS_ADDRESS"):
        return False
    try:
        from jeepney import DBus
        from jeepney.io.blocking import open_dbus_connection
        from jeepney.wrappers import unwrap_msg
        with open_dbus_connection(bus="SESSION", auth_timeout=DBUS_TIMEOUT_S) as connection:
            reply = connection.send_and_get_reply(DBus().NameHasOwner(SNI_WATCHER), timeout=DBUS_TIMEOUT_S)
            return bool(unwrap_msg(reply)[0])
    except Exception as exc:
        log.debug("cannot ask the session bus for a StatusNotifierWatcher: %s", exc)
        return False
