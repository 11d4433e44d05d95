"""What the text on a screen says about it: a bilingual (en/zh) vocabulary of screen concepts, entity
extraction (times, dates, links, amounts, unread counts) and the summary the OCR engine answers with.

The vocabulary is data: add a row to VOCABULARY (or ENTITY_KINDS), not an `if`. Everything here is a
pure function of the recognised lines; OCR text is untrusted and only ever quoted, never interpreted.
"""

from __future__ import annotations

import re
import unicodedata
from dataclasses import dataclass
from typing import Protocol, Sequence

from inference_worker.protocol import MAX_KEY_OBJECTS, OBJECT_MAX_CHARS, SUMMARY_MAX_CHARS


@dataclass(frozen=True)
class Concept:
    label: str                      # the key_object it adds, e.g. "email inbox"
    screen: str | None              # how a summary names a screen of this kind; None = not a kind of screen
    weight: float                   # how strongly a match names the screen (ties: table order)
    terms: tuple[str, ...]          # words and phrases, en and zh, most telling first
    patterns: tuple[str, ...] = ()  # regular expressions for what words cannot say (most telling first)
    needs: tuple[str, ...] = ()     # counts only when one of these concepts (labels) matched too
    hides: tuple[str, ...] = ()     # concepts (labels) this one makes redundant when both match

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
             "two-factor", "verification code", "忘记密码", "登录", "密码", "用户名", "验证码")),
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
    EntityKind("amount", "amount {0}", (       # as written: thousands separators and the currency kept
        r"(?P<v>[$€£¥￥]\s?(?:\d{1,3}(?:[,.]\d{3})+|\d+)(?:[.,]\d{1,2})?)(?!\d)",
        r"(?i)(?P<v>\b(?:\d{1,3}(?:[,.]\d{3})+|\d+)(?:[.,]\d{1,2})?\s?(?:usd|eur|gbp|cny|rmb|元|美元|欧元))")),
    EntityKind("link", "link {0}", (
        r"(?i)\b(?:https?://)(?P<v>[^\s\"'<>]+)", r"(?i)\b(?P<v>www\.[^\s\"'<>]+)",
        r"(?i)(?<![@\w.])(?P<v>[a-z0-9-]+(?:\.[a-z0-9-]+)*\.(?:com|org|net|io|dev|cn|co|ai|app|gov|edu)"
        r"(?:/[^\s\"'<>]*)?)(?![\w.])")),
)

_COMPILED_PATTERNS = {p: re.compile(p) for c in VOCABULARY for p in c.patterns}
_COMPILED_ENTITIES = [(kind, [re.compile(p) for p in kind.patterns]) for kind in ENTITY_KINDS]
_CONTROL = re.compile(r"[\u0000-\u001f\u007f-\u009f]+")
_CJK = re.compile(r"[\u3040-\u30ff\u3400-\u9fff\uf900-\ufaff]")


class LineLike(Protocol):
    text: str
    box: tuple[int, int, int, int]    # left, top, right, bottom


@dataclass(frozen=True)
class ConceptMatch:
    concept: Concept
    score: float
    evidence: tuple[tuple[int, int], ...]    # (rank of the term/pattern that matched, line index)

    def matched_terms(self) -> list[str]:
        """The terms and patterns that matched, most telling first (patterns rank before terms)."""
        vocabulary = self.concept.patterns + self.concept.terms
        return [vocabulary[rank] for rank in sorted({rank for rank, _ in self.evidence})]

    @property
    def strength(self) -> int:
        """Pieces of evidence: distinct (term, line) pairs, at most 4."""
        return min(len(set(self.evidence)), 4)

    @property
    def is_sure(self) -> bool:
        """A strong concept, or two pieces of evidence: one weak word ('report') is not enough."""
        return self.concept.is_strong or self.strength >= 2

    @property
    def names_screen(self) -> bool:
        return self.concept.screen is not None and self.is_sure


@dataclass(frozen=True)
class Entity:
    kind: str
    value: str
    line_index: int

    @property
    def key_object(self) -> str:
        label = next(k.label for k in ENTITY_KINDS if k.name == self.kind)
        return bounded(label.format(self.value), OBJECT_MAX_CHARS)


@dataclass(frozen=True)
class ScreenDescription:
    summary: str
    key_objects: list[str]
    kind: str                        # how the screen was named ("An email inbox"; "Text on screen" when unsure)
    matches: list[ConceptMatch]
    entities: list[Entity]
    quoted: list[int]                # indexes of the lines the summary quotes, in quoting order


# -------------------------------------------------------------------- text normalisation

def clean(text: str) -> str:
    """OCR text made safe to quote: NFKC (full-width forms to ASCII), no control characters, single spaces."""
    return " ".join(_CONTROL.sub(" ", unicodedata.normalize("NFKC", text)).split())


def schema_safe(text: str) -> str:
    """Text for DeskEye's answer schema, which admits no double quote or backslash (deskeye/prompt.py says why):
    a double quote as a single one, a backslash as a slash. Matching keeps seeing the text as read."""
    return text.replace('"', "'").replace("\\", "/")


def compact(text: str) -> str:
    """Lower case without spaces: OCR often drops or adds spaces on small screen text."""
    return "".join(clean(text).lower().split())


def bounded(text: str, max_chars: int) -> str:
    return text if len(text) <= max_chars else text[:max_chars - 1].rstrip() + "…"


@dataclass(frozen=True)
class Term:
    """A vocabulary term, prepared once: CJK terms and long Latin terms match anywhere in a line's compacted
    text (OCR drops and adds spaces); short Latin terms only as whole words ('mute' is not in 'minute')."""
    term: str
    compacted: str
    regex: re.Pattern | None      # None: substring match only (CJK)

    @classmethod
    def of(cls, term: str) -> "Term":
        words = [re.escape(w) for w in term.lower().split()]
        regex = None if _CJK.search(term) else re.compile(r"(?<![a-z])" + r"\s*".join(words) + r"(?![a-z])")
        return cls(term, compact(term), regex)

    @property
    def is_loose(self) -> bool:
        return self.regex is None or len(self.compacted) >= 6

    def found_in(self, line: "PreparedLine") -> bool:
        if self.is_loose and self.compacted in line.compact_words:
            return True
        return self.regex is not None and self.regex.search(line.lower_words) is not None


@dataclass(frozen=True)
class PreparedLine:
    """A line cleaned once for matching. Terms are looked for outside links and paths; patterns see the
    whole line."""
    text: str
    lower_words: str
    compact_words: str

    @classmethod
    def of(cls, text: str) -> "PreparedLine":
        cleaned = clean(text)
        words = _LINK.sub(" ", cleaned).lower()
        return cls(cleaned, words, "".join(words.split()))


_LINK = re.compile(r"(?i)\b(?:https?://|www\.)\S+|\b[\w.-]+\.(?:com|org|net|io|dev|cn|co|ai|app)(?:/\S*)?"
                   r"|\S*[/\\]\S*")   # links and paths: 'login' in a URL is no sign-in form
_TERMS = {t: Term.of(t) for c in VOCABULARY for t in c.terms}


def term_in(term: str, text: str) -> bool:
    """Whether a vocabulary term occurs in a line (see Term)."""
    return (_TERMS.get(term) or Term.of(term)).found_in(PreparedLine.of(text))


# -------------------------------------------------------------------- concepts and entities

def match_concepts(texts: Sequence[str]) -> list[ConceptMatch]:
    """Concepts the lines mention, best first. Score = weight x pieces of evidence (see ConceptMatch.strength)."""
    prepared = [PreparedLine.of(text) for text in texts]
    everything = PreparedLine("\n".join(p.text for p in prepared), "\n".join(p.lower_words for p in prepared),
                              "\n".join(p.compact_words for p in prepared))
    present = {term for term, prepared_term in _TERMS.items() if prepared_term.found_in(everything)}
    found: dict[str, ConceptMatch] = {}
    for concept in VOCABULARY:
        evidence = _evidence(concept, prepared, present)
        if evidence:
            found[concept.label] = ConceptMatch(concept, concept.weight * min(len(set(evidence)), 4),
                                                tuple(evidence))
    kept = [m for m in found.values() if not m.concept.needs or any(n in found for n in m.concept.needs)]
    hidden = {label for m in kept for label in m.concept.hides}
    return sorted([m for m in kept if m.concept.label not in hidden], key=lambda m: -m.score)  # ties: table order


def _evidence(concept: Concept, lines: Sequence[PreparedLine], present: set[str]) -> list[tuple[int, int]]:
    """(rank, line index) of each pattern and term found; terms are looked for only in lines when `present`
    (found in all the lines joined: a cheap first pass, since most terms are on no line)."""
    evidence = []
    terms = [(rank, term) for rank, term in enumerate(concept.terms, start=len(concept.patterns)) if term in present]
    for index, line in enumerate(lines):
        for rank, pattern in enumerate(concept.patterns):
            if _COMPILED_PATTERNS[pattern].search(line.text):
                evidence.append((rank, index))
        for rank, term in terms:
            if _TERMS[term].found_in(line):
                evidence.append((rank, index))
    return evidence


def extract_entities(texts: Sequence[str]) -> list[Entity]:
    """Times, dates, amounts, links and unread counts, in ENTITY_KINDS order, then reading order; no repeats."""
    entities: list[Entity] = []
    seen: set[tuple[str, str]] = set()
    for kind, regexes in _COMPILED_ENTITIES:
        for index, text in enumerate(texts):
            cleaned = clean(text)
            for regex in regexes:
                for found in regex.finditer(cleaned):
                    value = (found.groupdict().get("v") or found.group(0)).strip().rstrip(".,;:)")
                    if found.groupdict().get("n"):
                        value = f"{value}:{found.group('n')}"
                    if value and (kind.name, value.lower()) not in seen:
                        seen.add((kind.name, value.lower()))
                        entities.append(Entity(kind.name, value, index))
    return entities


# -------------------------------------------------------------------- the description

def describe(lines: Sequence[LineLike], frame_height: int) -> ScreenDescription:
    """Name the kind of screen, quote its salient lines (a title-like line first), list its key objects."""
    texts = [clean(line.text) for line in lines]
    if not any(texts):
        return ScreenDescription("No readable text on this screen.", [], "A screen without text", [], [], [])
    matches = match_concepts(texts)
    entities = extract_entities(texts)
    kind = next((m.concept.screen for m in matches if m.names_screen), None) or "Text on screen"
    order = salient_order(lines, texts, matches, entities, frame_height)
    summary, (quoted,) = compose_summary([(f"{kind}: ", [texts[i] for i in order])])
    return ScreenDescription(summary, key_objects(matches, entities), kind, matches, entities,
                             [order[i] for i in quoted])


def key_objects(matches: Sequence[ConceptMatch], entities: Sequence[Entity]) -> list[str]:
    """Labels of the concepts we are sure of (best first, at most 4; the best one even when unsure), then
    entities taking turns by kind (the first of each kind in ENTITY_KINDS order — unread counts first —,
    then the second, ...), bounded and unique."""
    concepts = [m for i, m in enumerate(matches) if i == 0 or m.is_sure][:4]
    by_kind = [[e for e in entities if e.kind == kind.name] for kind in ENTITY_KINDS]
    turns = [group[i] for i in range(max(map(len, by_kind), default=0)) for group in by_kind if i < len(group)]
    objects: list[str] = []
    for item in [m.concept.label for m in concepts] + [e.key_object for e in turns]:
        item = bounded(schema_safe(clean(item)), OBJECT_MAX_CHARS)
        if item and item not in objects:
            objects.append(item)
    return objects[:MAX_KEY_OBJECTS]


def title_index(lines: Sequence[LineLike], texts: Sequence[str], frame_height: int) -> int | None:
    """The title-like line: the tallest box, with lines near the top preferred."""
    candidates = [i for i, t in enumerate(texts) if len(re.findall(r"\w", t)) >= 2]
    if not candidates:
        return None
    max_height = max(_height(lines[i]) for i in candidates) or 1

    def score(i: int) -> float:
        return _height(lines[i]) / max_height + 0.25 * (1 - lines[i].box[1] / max(1, frame_height))
    return max(candidates, key=lambda i: (round(score(i), 3), -i))


def salient_order(lines: Sequence[LineLike], texts: Sequence[str], matches: Sequence[ConceptMatch],
                  entities: Sequence[Entity], frame_height: int, *, title_first: bool = True) -> list[int]:
    """Line indexes, most worth quoting first: the title (unless the caller knows it: `title_first`), lines that
    made the best concepts match (their most telling term first), lines holding entities, then the rest in
    reading order. No duplicate texts."""
    rank: dict[int, tuple] = {}
    for concept_rank, match in enumerate(matches):
        for term_rank, index in match.evidence:
            rank[index] = min(rank.get(index, (9e9,)), (concept_rank, term_rank, index))
    for entity in entities:
        rank.setdefault(entity.line_index, (len(matches), 0, entity.line_index))
    title = title_index(lines, texts, frame_height) if title_first else None
    order = sorted(range(len(texts)), key=lambda i: (i != title, rank.get(i, (9e9, 0, i))))
    unique, seen = [], set()
    for i in order:
        if texts[i] and compact(texts[i]) not in seen:
            seen.add(compact(texts[i]))
            unique.append(i)
    return unique


def compose_summary(sections: Sequence[tuple[str, Sequence[str]]], max_chars: int = SUMMARY_MAX_CHARS,
                    max_quote_chars: int = 90) -> tuple[str, list[list[int]]]:
    """Each section's heading, then its texts as “quotes”; “separated”, in order, skipping texts that no
    longer fit in `max_chars`. A section none of whose texts fit is left out (heading too), except the first.
    Returns the summary and, per section, the indexes of the texts it quotes."""
    summary, quoted_per_section = "", []
    for number, (heading, texts) in enumerate(sections):
        part, quoted = heading, []
        for index, text in enumerate(texts):
            piece = ("; " if quoted else "") + f"“{bounded(schema_safe(text), max_quote_chars)}”"
            if len(summary) + len(part) + len(piece) <= max_chars:
                part += piece
                quoted.append(index)
        if quoted or number == 0:
            summary += part if quoted else part.rstrip(": ")
        quoted_per_section.append(quoted)
    return bounded(summary, max_chars), quoted_per_section


def _height(line: LineLike) -> int:
    return line.box[3] - line.box[1]
