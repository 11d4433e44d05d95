"""The bilingual (en/zh) vocabulary of screen concepts and the kinds of entity the OCR engine extracts: data only.

Add a row to VOCABULARY (or ENTITY_KINDS), not an `if`: `concepts` matches these rows against the recognised
lines, and `layout` reads ERROR_TERMS and WARNING_TERMS for a dialog's flavour.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Concept:
    label: str                      # the key_object it adds, e.g. "email inbox"
    screen: str | None              # how a summary names a screen of this kind; None = not a kind of screen
    weight: float                   # how strongly a match names the screen (ties: table order)
    terms: tuple[str, ...]          # words and phrases, en and zh, most telling first
    patterns: tuple[str, ...] = ()  # regular expressions for what words cannot say (most telling first)
    needs: tuple[str, ...] = ()     # counts only when one of these concepts (labels) matched too
    hides: tuple[str, ...] = ()     # concepts (labels) this one makes redundant when both match
    layout: str | None = None       # claimed only in a window whose layout is this kind (`layout.KINDS`): a sign-in
                                    # form is a form; the word "password" in a message or in notes makes none

    @property
    def is_strong(self) -> bool:
        """One piece of evidence is enough to name the screen after a strong concept; others need two."""
        return self.weight >= 3.0


ERROR_TERMS = ("an error occurred", "could not", "couldn't", "unable to", "failed to", "error", "failed",
               "failure", "exception", "fatal", "not responding", "crashed", "access denied", "permission denied",
               "出错", "错误", "失败", "异常", "无法", "崩溃", "拒绝访问")
WARNING_TERMS = ("warning", "caution", "are you sure", "deprecated", "unsaved changes", "警告", "注意", "确定要")
DIALOG_BUTTONS = r"(?i)^\s*(ok|cancel|retry|abort|ignore|yes|no|close|try again|don't save|details)\s*$"

VOCABULARY: tuple[Concept, ...] = (
    Concept("python traceback", "A Python traceback", 4.0,
            ("traceback (most recent call last)", "most recent call last"),
            (r"^\s*[A-Z]\w*(Error|Exception|Interrupt|Exit)\b:?", r"File \".+\", ?line \d+")),
    Concept("error dialog", "An error dialog", 3.5, ERROR_TERMS, needs=("dialog",), hides=("error", "dialog")),
    Concept("warning dialog", "A warning dialog", 3.0, WARNING_TERMS, needs=("dialog",), hides=("warning", "dialog")),
    Concept("login form", "A sign-in form", 3.0,
            ("forgot password", "remember me", "sign in", "log in", "login", "password", "username",
             "two-factor", "verification code", "忘记密码", "登录", "密码", "用户名", "验证码"), layout="form"),
    Concept("video call", "A video call", 3.0,
            ("leave meeting", "end call", "share screen", "unmute", "mute", "participants", "camera",
             "zoom meeting", "google meet", "microsoft teams", "离开会议", "共享屏幕", "静音", "参会者", "视频通话")),
    Concept("meeting reminder", "A calendar reminder", 3.0,
            ("starts in", "starting now", "join meeting", "snooze", "dismiss", "reminder", "upcoming",
             "即将开始", "稍后提醒", "加入会议", "提醒")),
    Concept("email inbox", "An email inbox", 2.5,
            ("inbox", "unread", "compose", "new mail", "new email", "reply all", "sent items", "drafts",
             "收件箱", "未读", "写邮件", "发件箱", "已发送", "草稿箱", "邮件"),
            (r"(?i)^\s*(from|to|cc|subject)\s*:",)),
    Concept("calendar", "A calendar", 2.0,
            ("calendar", "meeting", "agenda", "all-day", "all day", "schedule", "appointment", "event",
             "日历", "会议", "日程", "预约")),
    Concept("terminal", "A terminal", 2.0,
            ("command not found", "no such file or directory", "terminal", "bash", "zsh", "powershell",
             "sudo", "pip install", "终端", "命令行"),
            (r"^\s*[\w.-]+@[\w.-]+:\S*\s*[$#]", r"^\s*[$#>]\s+\S", r"^\s*PS [A-Z]:\\", r"^\s*>>>\s")),
    Concept("code editor", "A code editor", 2.0,
            ("visual studio code", "vs code", "pycharm", "intellij", "sublime text", "代码", "编辑器"),
            (r"^\s*(def|class)\s+\w+.*:\s*$", r"^\s*(import|from)\s+[\w.]+", r"^\s*(function|const|let|var)\s+\w+",
             r"^\s*#include\s*[<\"]", r"^\s*(public|private|static)\s+\w+", r"[;{}]\s*$", r"^\s*return\b")),
    Concept("spreadsheet", "A spreadsheet", 2.0,
            ("spreadsheet", "excel", "google sheets", "sheet1", "libreoffice calc", "工作表", "电子表格"),
            (r"=\s*(SUM|AVERAGE|VLOOKUP|COUNT|IF)\(", r"^\s*[A-H]\s+[B-I]\s+[C-J]\b")),
    Concept("chart", "A chart", 2.0,
            ("chart", "graph", "legend", "axis", "trend", "dashboard", "图表", "折线图", "柱状图", "饼图", "趋势")),
    Concept("table", "A table", 1.5,
            ("subtotal", "grand total", "columns", "rows", "表格", "合计", "总计"),
            (r"(?:\b\d[\d,.]*%?\s+){3,}",)),
    Concept("chat", "A chat", 2.0,
            ("type a message", "send a message", "message", "typing", "online", "slack", "wechat", "whatsapp",
             "telegram", "聊天", "消息", "微信", "在线")),
    Concept("web browser", "A web page", 1.5,
            ("new tab", "bookmarks", "search google", "chrome", "firefox", "safari", "浏览器", "新标签页", "书签"),
            (r"(?i)\bhttps?://", r"(?i)\bwww\.")),
    Concept("document", "A document", 1.5,
            ("document", "word count", "paragraph", "heading", "chapter", "page", "draft", "report", "pdf",
             "文档", "字数", "段落", "标题", "章节", "报告")),
    Concept("notification", "A notification", 1.5,
            ("notification", "new message", "just now", "mentioned you", "replied", "通知", "新消息", "刚刚")),
    Concept("low battery", "A low-battery warning", 3.0,
            ("low battery", "battery low", "battery critical", "plug in", "电量不足", "电量低", "请连接电源")),
    Concept("update", "An update prompt", 2.0,
            ("update available", "restart to update", "install update", "updates", "有可用更新", "更新", "升级")),
    Concept("download", "A download", 1.5,
            ("downloading", "download", "uploading", "progress", "remaining", "下载", "上传", "进度", "剩余")),
    Concept("shopping", "A shopping page", 2.0,
            ("add to cart", "checkout", "shopping cart", "order", "invoice", "payment", "price", "shipping",
             "购物车", "结算", "订单", "支付", "价格", "发票")),
    Concept("settings", "A settings page", 1.5, ("settings", "preferences", "options", "设置", "偏好", "选项")),
    Concept("file manager", "A file manager", 1.5,
            ("file manager", "folder", "downloads", "documents", "desktop", "recent files", "文件夹", "我的文档")),
    Concept("media player", "A media player", 1.5,
            ("now playing", "playlist", "pause", "play", "volume", "正在播放", "播放列表", "暂停", "播放")),
    Concept("search results", "Search results", 2.0,
            ("search results", "results for", "did you mean", "搜索结果", "搜索"), (r"(?i)\babout [\d,]+ results\b",)),
    Concept("error", "An error message", 2.0, ERROR_TERMS),
    Concept("warning", "A warning", 1.5, WARNING_TERMS),
    Concept("dialog", "A dialog", 1.0, ("确定", "取消", "重试", "关闭"), (DIALOG_BUTTONS,)),
)


@dataclass(frozen=True)
class EntityKind:
    name: str
    label: str                      # key_object format; {0} is the value as read
    patterns: tuple[str, ...]       # the value is group "v" when present, else the whole match


_MONTH = (r"(?:jan(?:uary)?|feb(?:ruary)?|mar(?:ch)?|apr(?:il)?|may|june?|july?|aug(?:ust)?|sept?(?:ember)?"
          r"|oct(?:ober)?|nov(?:ember)?|dec(?:ember)?)\b")
_FIGURE = r"(?:\d{1,3}(?:[,.]\d{3})+|\d+)(?:[.,]\d{1,2})?"
#: the figure's magnitude is part of the amount: "$4.2M" is not "$4.2" (a letter must end there: "$5 bonus" has none)
_MAGNITUDE = (r"(?:\s?(?:[KkMmBbT]n?|thousand|million|billion|trillion)(?![A-Za-z])"
              r"|\s?(?:千|万|萬|百万|百萬|千万|千萬|亿|億))?")
ENTITY_KINDS: tuple[EntityKind, ...] = (
    EntityKind("error name", "{0}", (
        r"(?<![\w.])(?:[a-z_][\w]*\.)*(?P<v>[A-Z][A-Za-z0-9]*(?:Error|Exception|Interrupt|Warning|Fault))"
        r"(?![A-Za-z0-9])",
        # a traceback's last line starts with the name and a colon, which small fonts make OCR read as t, i or ;
        r"^(?:[a-z_][\w]*\.)*(?P<v>[A-Z][A-Za-z0-9]*(?:Error|Exception))[ti;](?=\s|['\"(\[]|$)")),
    EntityKind("source line", "{0}", (       # group "n" is the line number: "calc.py:2"
        r"File \"(?:[^\"]*[/\\])?(?P<v>[^\"/\\]{1,60})\", ?line (?P<n>\d{1,7})",   # OCR may drop the space
        r"(?<![\w/.-])(?:[\w.-]*/)*(?P<v>[\w-]{1,60}\.[A-Za-z]{1,5}):(?P<n>\d{1,7})(?![\d])")),
    EntityKind("unread", "{0} unread", (
        r"(?i)\b(?P<v>\d{1,5})\s*(unread|new (messages?|emails?|mails?))\b", r"(?i)\bunread\s*[(:]?\s*(?P<v>\d{1,5})",
        r"(?i)\binbox\s*\(\s*(?P<v>\d{1,5})\s*\)", r"(?P<v>\d{1,5})\s*(封|条|个)?\s*未读", r"未读\s*[(:]?\s*(?P<v>\d{1,5})",
        r"收件箱\s*\(\s*(?P<v>\d{1,5})\s*\)")),
    EntityKind("time", "time {0}", (
        r"(?i)(?<![\d:])(?P<v>(?:[01]?\d|2[0-3]):[0-5]\d(?:\s?[ap]\.?m\.?)?)(?![\d:])",
        r"(?i)(?<![\d:])(?P<v>(?:1[0-2]|0?[1-9])\s?[ap]\.?m\.?)(?![a-z])",
        r"(?P<v>(?:上午|下午|中午|晚上|凌晨)?\d{1,2}\s*[点點时](?:\d{1,2}分|半)?)")),
    EntityKind("date", "date {0}", (
        r"(?P<v>\b\d{4}[-/.]\d{1,2}[-/.]\d{1,2}\b)", r"(?P<v>\b\d{1,2}/\d{1,2}/\d{2,4}\b)",
        r"(?P<v>\d{4}年\d{1,2}月\d{1,2}[日号])", r"(?P<v>\d{1,2}月\d{1,2}[日号])",
        r"(?i)(?P<v>\b" + _MONTH + r"\.?\s\d{1,2}(?:,\s?\d{4})?\b)",
        r"(?i)(?P<v>\b\d{1,2}\s" + _MONTH + r"\.?(?:\s\d{4})?\b)")),
    EntityKind("amount", "amount {0}", (       # as written: separators, the currency and the magnitude kept
        r"(?P<v>[$€£¥￥]\s?" + _FIGURE + _MAGNITUDE + r")(?!\d)",
        r"(?i)(?P<v>\b" + _FIGURE + _MAGNITUDE + r"\s?(?:usd|eur|gbp|cny|rmb|元|美元|欧元))")),
    EntityKind("link", "link {0}", (
        r"(?i)\b(?:https?://)(?P<v>[^\s\"'<>]+)", r"(?i)\b(?P<v>www\.[^\s\"'<>]+)",
        r"(?i)(?<![@\w.])(?P<v>[a-z0-9-]+(?:\.[a-z0-9-]+)*\.(?:com|org|net|io|dev|cn|co|ai|app|gov|edu)"
        r"(?:/[^\s\"'<>]*)?)(?![\w.])")),
)
