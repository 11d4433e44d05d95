"""The OCR engine's own words in each language DeskEye speaks: the framing around what it quotes ("About …: ",
". Also on screen: ") and the names of the kinds of screen ("A terminal").

The engine quotes the screen as it reads it and frames the quotes in the user's language: the request's
`deskeye.language` when the app sends it, else the question's (Chinese when it holds a Chinese character, in its
script), else English. Every phrase lives here, keyed by the English text the engine composes, so that a
translation pass finds them in one place. The worker does not import the app (`deskeye`): the script rule is
copied from deskeye/language.py (tests/test_ocr_language.py keeps the two agreeing).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping

ENGLISH, SIMPLIFIED_CHINESE, TRADITIONAL_CHINESE = "en", "zh_CN", "zh_TW"

# Characters written only one way in each script (deskeye/language.py's sets): how a question's script is told.
_SIMPLIFIED_ONLY = frozenset("这个们来时说为会对发问题么见还开关应该与学国体点电脑视错误档网页邮设显钟议话请读写图书车东长门"
                             "间无没过进动现实经样让认识号码户额钱单订报数务录气费总结统计给从两边吗账帐处语译钮键标签执运"
                             "启败储删复贴乱释义")
_TRADITIONAL_ONLY = frozenset("這個們來時說為會對發問題麼見還開關應該與學國體點電腦視錯誤檔網頁郵設顯鐘議話請讀寫圖書車東長門"
                              "間無沒過進動現實經樣讓認識號碼戶額錢單訂報數務錄氣費總結統計給從兩邊嗎賬帳處語譯鈕鍵標籤執運"
                              "啟敗儲刪復貼亂釋義")

# The kinds of screen the engine names (layout.KINDS and the vocabulary's `screen`), English -> (zh_CN, zh_TW).
# A kind missing here stays English; tests/test_ocr_language.py checks every kind the engine can name is here.
KIND_NAMES: dict[str, tuple[str, str]] = {
    "Text on screen": ("屏幕上的文字", "螢幕上的文字"),
    "A window": ("一个窗口", "一個視窗"),
    "A screen without text": ("没有文字的屏幕", "沒有文字的螢幕"),
    "A calculator": ("计算器", "計算機"),
    "A clock": ("时钟", "時鐘"),
    "A spreadsheet": ("电子表格", "試算表"),
    "A table": ("表格", "表格"),
    "A terminal": ("终端", "終端機"),
    "A code editor": ("代码编辑器", "程式碼編輯器"),
    "A form": ("表单", "表單"),
    "An email inbox": ("邮件收件箱", "郵件收件匣"),
    "A list": ("列表", "清單"),
    "A dialog": ("对话框", "對話框"),
    "An error dialog": ("错误对话框", "錯誤對話框"),
    "A warning dialog": ("警告对话框", "警告對話框"),
    "A question dialog": ("询问对话框", "詢問對話框"),
    "A document": ("文档", "文件"),
    "A Python traceback": ("Python 错误回溯", "Python 錯誤回溯"),
    "A sign-in form": ("登录表单", "登入表單"),
    "A video call": ("视频通话", "視訊通話"),
    "A calendar reminder": ("日历提醒", "行事曆提醒"),
    "A calendar": ("日历", "行事曆"),
    "A chart": ("图表", "圖表"),
    "A chat": ("聊天", "聊天"),
    "A web page": ("网页", "網頁"),
    "A notification": ("通知", "通知"),
    "A low-battery warning": ("电量不足警告", "電量不足警告"),
    "An update prompt": ("更新提示", "更新提示"),
    "A download": ("下载", "下載"),
    "A shopping page": ("购物页面", "購物頁面"),
    "A settings page": ("设置页面", "設定頁面"),
    "A file manager": ("文件管理器", "檔案管理員"),
    "A media player": ("媒体播放器", "媒體播放器"),
    "Search results": ("搜索结果", "搜尋結果"),
    "An error message": ("错误信息", "錯誤訊息"),
    "A warning": ("警告", "警告"),
}


@dataclass(frozen=True)
class Wording:
    """One language's framing. Templates take `asked` (the question's words, already quoted and joined) and
    `kind` (a kind's name in this language)."""
    language: str
    about: str                  # before the lines that mention the question's words
    also_on_screen: str         # before the other lines
    nothing_mentions: str       # no line mentions the question's words; then the screen by kind
    behind_it: str              # before a window behind the foreground one
    no_text: str                # a screen without readable text
    quote: str                  # one quoted word of the question (quoted lines are always “…”, as composed)
    word_separator: str         # between the quoted words of the question
    line_separator: str         # between quoted lines
    heading_end: str            # after a kind's name (and a window's title), before its lines
    kinds: Mapping[str, str] = field(default_factory=dict)

    def kind(self, english: str) -> str:
        """A kind's name in this language (an unknown kind as the engine named it)."""
        return self.kinds.get(english, english)

    def asked(self, words: list[str]) -> str:
        return self.word_separator.join(self.quote.format(word) for word in words)


ENGLISH_WORDING = Wording(
    ENGLISH, about="About {asked}: ", also_on_screen=". Also on screen: ",
    nothing_mentions="Nothing on screen mentions {asked}. {kind}: ", behind_it=". Behind it, {kind}",
    no_text="No readable text on this screen.", quote="“{}”", word_separator=", ", line_separator="; ",
    heading_end=": ")
WORDINGS = {
    ENGLISH: ENGLISH_WORDING,
    SIMPLIFIED_CHINESE: Wording(
        SIMPLIFIED_CHINESE, about="关于{asked}：", also_on_screen="。屏幕上还有：",
        nothing_mentions="屏幕上没有提到{asked}。{kind}：", behind_it="。后面是{kind}",
        no_text="屏幕上没有可读的文字。", quote="“{}”", word_separator="、", line_separator="；", heading_end="：",
        kinds={english: names[0] for english, names in KIND_NAMES.items()}),
    TRADITIONAL_CHINESE: Wording(
        TRADITIONAL_CHINESE, about="關於{asked}：", also_on_screen="。螢幕上還有：",
        nothing_mentions="螢幕上沒有提到{asked}。{kind}：", behind_it="。後面是{kind}",
        no_text="螢幕上沒有可讀的文字。", quote="“{}”", word_separator="、", line_separator="；", heading_end="：",
        kinds={english: names[1] for english, names in KIND_NAMES.items()}),
}


def wording_for(language: str | None, question: str) -> Wording:
    """The wording for the request's language; without one, the question's (see the module's docstring)."""
    return WORDINGS[language or question_language(question)]


def question_language(question: str) -> str:
    """"zh_TW" or "zh_CN" for a question holding a Chinese character (by its script, simplified when it does not
    tell), else "en"."""
    if not any("\u3400" <= char <= "\u9fff" for char in question):
        return ENGLISH
    num_simplified = sum(char in _SIMPLIFIED_ONLY for char in question)
    num_traditional = sum(char in _TRADITIONAL_ONLY for char in question)
    return TRADITIONAL_CHINESE if num_traditional > num_simplified else SIMPLIFIED_CHINESE


def reframe(summary: str, wording: Wording) -> str:
    """A summary the engine composed in English (`screen.describe_screen`) with its framing in `wording`'s language.

    Only framing is translated: the summary alternates framing and “quotes” (lines, window titles), and a framing
    piece is replaced only when it is exactly one the engine writes ("A terminal: ", "; ", ". Behind it, a
    dialog "). Quoted screen text is kept as read; a piece that is not recognised (a quote holding ” itself) stays
    as it is, so screen text can never make the engine write something the screen did not say."""
    if wording.language == ENGLISH:
        return summary
    if summary == ENGLISH_WORDING.no_text:
        return wording.no_text
    pieces, position = [], 0
    while position < len(summary):
        start = summary.find("“", position)
        start = len(summary) if start < 0 else start
        framing = summary[position:start]
        pieces.append(_framings(wording).get(framing, framing))
        end = summary.find("”", start)
        end = len(summary) if end < 0 else end + 1
        pieces.append(summary[start:end])          # quoted screen text, as read
        position = end
    return "".join(pieces)


def _framings(wording: Wording) -> dict[str, str]:
    """Every framing piece the English composer writes -> the same in `wording`, built once per language."""
    cached = _FRAMINGS.get(wording.language)
    if cached is None:
        english = ENGLISH_WORDING
        cached = {english.line_separator: wording.line_separator, english.heading_end: wording.heading_end,
                  english.also_on_screen: wording.also_on_screen}
        for kind in KIND_NAMES:
            name, lower = wording.kind(kind), kind[0].lower() + kind[1:]
            behind = english.behind_it.format(kind=lower)
            for tail, translated in (("", ""), (" ", ""), (english.heading_end, wording.heading_end)):
                cached[kind + tail] = name + translated
                cached[behind + tail] = wording.behind_it.format(kind=name) + translated
        _FRAMINGS[wording.language] = cached
    return cached


_FRAMINGS: dict[str, dict[str, str]] = {}
