//! The word list for [`crate::word_guess`]: 490 common English five-letter
//! words, lowercase, sorted and without repeats (a test checks all three).

/// Secret words for [`crate::word_guess`], and the dictionary used when
/// `allow_unknown_words` is off.
pub const WORDS: &[&str] = &[
    "about", "above", "abuse", "actor", "acute", "admit", "adopt", "adult", "after", "again",
    "agent", "agree", "ahead", "alarm", "album", "alert", "alike", "alive", "allow", "alone",
    "along", "alter", "among", "anger", "angle", "angry", "apart", "apple", "apply", "arena",
    "argue", "arise", "array", "aside", "asset", "audio", "audit", "avoid", "award", "aware",
    "badly", "baker", "basic", "beach", "began", "begin", "being", "below", "bench", "birth",
    "black", "blade", "blame", "blank", "blind", "block", "blood", "board", "boost", "booth",
    "bound", "brain", "brand", "bread", "break", "breed", "brief", "bring", "broad", "broke",
    "brown", "build", "built", "buyer", "cabin", "cable", "candy", "carry", "catch", "cause",
    "chain", "chair", "chalk", "charm", "chart", "chase", "cheap", "check", "chest", "chief",
    "child", "chose", "civil", "claim", "class", "clean", "clear", "click", "climb", "clock",
    "close", "cloud", "coach", "coast", "could", "count", "court", "cover", "crack", "craft",
    "crash", "cream", "crime", "cross", "crowd", "crown", "curve", "cycle", "daily", "dance",
    "dated", "dealt", "death", "debut", "delay", "depth", "doing", "doubt", "dozen", "draft",
    "drama", "drawn", "dream", "dress", "drink", "drive", "drove", "dying", "eager", "early",
    "earth", "eight", "elite", "empty", "enemy", "enjoy", "enter", "entry", "equal", "error",
    "event", "every", "exact", "exist", "extra", "faith", "false", "fault", "fiber", "field",
    "fifth", "fifty", "fight", "final", "first", "fixed", "flash", "fleet", "floor", "fluid",
    "focus", "force", "forth", "forty", "forum", "found", "frame", "frank", "fresh", "front",
    "fruit", "fully", "funny", "giant", "given", "glass", "globe", "grace", "grade", "grain",
    "grand", "grant", "grass", "great", "green", "gross", "group", "grown", "guard", "guess",
    "guest", "guide", "happy", "heart", "heavy", "horse", "hotel", "house", "human", "ideal",
    "image", "index", "inner", "input", "issue", "joint", "judge", "juice", "knife", "known",
    "label", "large", "laser", "later", "laugh", "layer", "learn", "lease", "least", "leave",
    "legal", "lemon", "level", "light", "limit", "local", "logic", "loose", "lucky", "lunch",
    "magic", "major", "maker", "march", "match", "maybe", "mayor", "meant", "media", "metal",
    "might", "minor", "mixed", "model", "money", "month", "moral", "motor", "mount", "mouse",
    "mouth", "movie", "music", "needs", "never", "newly", "night", "noise", "north", "novel",
    "nurse", "ocean", "offer", "often", "order", "other", "ought", "owner", "paint", "panel",
    "paper", "party", "peace", "phase", "phone", "photo", "piano", "piece", "pilot", "pitch",
    "place", "plain", "plane", "plant", "plate", "point", "pound", "power", "press", "price",
    "pride", "prime", "print", "prior", "prize", "proof", "proud", "prove", "queen", "quick",
    "quiet", "quite", "radio", "raise", "range", "rapid", "ratio", "reach", "ready", "realm",
    "refer", "relax", "reply", "right", "rival", "river", "robot", "rough", "round", "route",
    "royal", "rural", "salad", "scale", "scene", "scope", "score", "sense", "serve", "seven",
    "shade", "shake", "shall", "shape", "share", "sharp", "sheep", "sheet", "shelf", "shell",
    "shift", "shine", "shirt", "shock", "shoot", "short", "shown", "sight", "silly", "since",
    "sixth", "sixty", "skill", "sleep", "slice", "slide", "small", "smart", "smile", "smoke",
    "solid", "solve", "sorry", "sound", "south", "space", "spare", "speak", "speed", "spend",
    "spent", "split", "spoke", "sport", "staff", "stage", "stake", "stand", "start", "state",
    "steam", "steel", "stick", "still", "stock", "stone", "stood", "store", "storm", "story",
    "strip", "stuck", "study", "stuff", "style", "sugar", "suite", "sunny", "super", "sweet",
    "table", "taken", "taste", "teach", "teeth", "thank", "theme", "there", "thick", "thing",
    "think", "third", "those", "three", "threw", "throw", "tight", "tired", "title", "today",
    "topic", "total", "touch", "tough", "tower", "track", "trade", "train", "treat", "trend",
    "trial", "tribe", "trick", "tried", "truck", "truly", "trust", "truth", "twice", "uncle",
    "under", "union", "unity", "until", "upper", "upset", "urban", "usage", "usual", "valid",
    "value", "video", "virus", "visit", "vital", "voice", "waste", "watch", "water", "wheel",
    "where", "which", "while", "white", "whole", "whose", "woman", "women", "world", "worry",
    "worth", "would", "wound", "write", "wrong", "wrote", "yield", "young", "youth", "zebra",
];

/// Whether `word` (lowercase) is in [`WORDS`].
pub fn contains(word: &str) -> bool {
    WORDS.binary_search(&word).is_ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn words_are_five_lowercase_letters_sorted_and_unique() {
        assert!(WORDS.len() >= 300, "only {} words", WORDS.len());
        for word in WORDS {
            assert_eq!(word.len(), 5, "{word}");
            assert!(word.bytes().all(|b| b.is_ascii_lowercase()), "{word}");
        }
        // Sorted without repeats, so `contains` can binary-search.
        assert!(WORDS.windows(2).all(|pair| pair[0] < pair[1]));
    }

    #[test]
    fn contains_finds_listed_words_only() {
        assert!(contains("apple"));
        assert!(!contains("zzzzz"));
    }
}
