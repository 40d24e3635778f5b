(define (problem plan_trial_T20261122_100002_000002)
    (:domain alfred)
    (:objects
        agent1 - agent
        BookType - otype
        DeskLampType - otype
        BedType - rtype
        DeskType - rtype
        Book_bar__minus_00_dot_72_bar__plus_00_dot_56_bar__minus_01_dot_30 - object
        DeskLamp_bar__plus_01_dot_90_bar__plus_00_dot_74_bar__plus_00_dot_62 - object
        Bed_bar__minus_00_dot_91_bar__plus_00_dot_00_bar__minus_01_dot_45 - receptacle
        Desk_bar__plus_01_dot_97_bar__plus_00_dot_00_bar__plus_00_dot_55 - receptacle
        loc_bar__minus_4_bar__minus_3_bar_2_bar_45 - location
        loc_bar_6_bar_2_bar_1_bar_45 - location
        loc_bar_0_bar_2_bar_1_bar_30 - location
        )
    (:init
        (receptacleType Bed_bar__minus_00_dot_91_bar__plus_00_dot_00_bar__minus_01_dot_45 BedType)
        (receptacleType Desk_bar__plus_01_dot_97_bar__plus_00_dot_00_bar__plus_00_dot_55 DeskType)
        (objectType Book_bar__minus_00_dot_72_bar__plus_00_dot_56_bar__minus_01_dot_30 BookType)
        (objectType DeskLamp_bar__plus_01_dot_90_bar__plus_00_dot_74_bar__plus_00_dot_62 DeskLampType)
        (canContain BedType BookType)
        (canContain DeskType BookType)
        (pickupable Book_bar__minus_00_dot_72_bar__plus_00_dot_56_bar__minus_01_dot_30)
        (toggleable DeskLamp_bar__plus_01_dot_90_bar__plus_00_dot_74_bar__plus_00_dot_62)
        (atLocation agent1 loc_bar_0_bar_2_bar_1_bar_30)
        (receptacleAtLocation Bed_bar__minus_00_dot_91_bar__plus_00_dot_00_bar__minus_01_dot_45 loc_bar__minus_4_bar__minus_3_bar_2_bar_45)
        (receptacleAtLocation Desk_bar__plus_01_dot_97_bar__plus_00_dot_00_bar__plus_00_dot_55 loc_bar_6_bar_2_bar_1_bar_45)
        (inReceptacle Book_bar__minus_00_dot_72_bar__plus_00_dot_56_bar__minus_01_dot_30 Bed_bar__minus_00_dot_91_bar__plus_00_dot_00_bar__minus_01_dot_45)
        (inReceptacle DeskLamp_bar__plus_01_dot_90_bar__plus_00_dot_74_bar__plus_00_dot_62 Desk_bar__plus_01_dot_97_bar__plus_00_dot_00_bar__plus_00_dot_55)
        (objectAtLocation Book_bar__minus_00_dot_72_bar__plus_00_dot_56_bar__minus_01_dot_30 loc_bar__minus_4_bar__minus_3_bar_2_bar_45)
        (objectAtLocation DeskLamp_bar__plus_01_dot_90_bar__plus_00_dot_74_bar__plus_00_dot_62 loc_bar_6_bar_2_bar_1_bar_45)
        )
    (:goal
        (and
            (exists (?ot - object ?r - receptacle ?a - agent ?l - location)
                (and
                    (objectType ?ot DeskLampType)
                    (toggleable ?ot)
                    (isToggled ?ot)
                    (receptacleAtLocation ?r ?l)
                    (atLocation ?a ?l)
                    (inReceptacle ?ot ?r)
                )
            )
            (exists (?o - object ?a - agent)
                (and
                    (objectType ?o BookType)
                    (holds ?a ?o)
                )
            )
        )
    )
)
